"""The tpu platform's kernels in JAX: Pallas paged attention, RMSNorm and the sampler's draw.

Every function takes ``interpret``: True runs the Pallas kernels with ``interpret=True`` (on
JAX's CPU backend, ``OCTAVO_PALLAS_INTERPRET=1``), False compiles them with Mosaic for a TPU.
"""
