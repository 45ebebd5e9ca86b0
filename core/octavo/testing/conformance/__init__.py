"""The platform conformance suite: every platform's kernels against ``octavo.ops.reference``.

    pytest --pyargs octavo.testing.conformance --octavo-platform NAME

Options (from ``octavo.testing.pytest_plugin``): ``--octavo-plugin MODULE`` registers an extra
in-process plugin (a kernel pack under test); ``--octavo-conformance-quick`` trims the matrix for
slow back-ends (e.g. Triton under ``TRITON_INTERPRET=1``). Inputs are built on the host and moved
to the device ``platform.device_init()`` returns; tolerances are in ``tolerances``.
"""
