"""Where the kernels run: on a GPU, or in the Triton interpreter on CPU tensors.

The interpreter (``TRITON_INTERPRET=1``) runs every kernel program in Python with numpy, so the
kernels can be checked against ``octavo.ops.reference`` on a machine without a GPU. A platform
plugin reports itself available under the interpreter only when asked to explicitly, with
``OCTAVO_TRITON_INTERPRET_DEVICE=<platform name>``: it then computes on ``torch.device("cpu")``.
"""

from __future__ import annotations

import os

import torch

INTERPRET_ENV = "TRITON_INTERPRET"
INTERPRET_DEVICE_ENV = "OCTAVO_TRITON_INTERPRET_DEVICE"


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0")


def emulated(platform_name: str) -> bool:
    """True when ``platform_name`` is asked to run its kernels in the interpreter on the CPU."""
    return interpreting() and os.environ.get(INTERPRET_DEVICE_ENV, "") == platform_name


def emulation_reason(platform_name: str) -> str:
    """The detection reason of an emulated platform."""
    return (
        f"Triton interpreter on the CPU ({INTERPRET_ENV}=1, "
        f"{INTERPRET_DEVICE_ENV}={platform_name}); kernels are checked, not fast"
    )


def emulation_hint(platform_name: str) -> str:
    """How to emulate ``platform_name`` on a machine without its GPU, for detection reasons."""
    return f"to emulate it on the CPU set {INTERPRET_ENV}=1 {INTERPRET_DEVICE_ENV}={platform_name}"


def upcast_loads(dtype: torch.dtype, interpret: bool | None = None) -> bool:
    """Whether kernels must convert loaded values to float32 before any arithmetic.

    The interpreter has no bfloat16 arithmetic (it cannot even build a bfloat16 constant), so
    bfloat16 inputs are upcast on load there; float32 needs no conversion and float16 works.
    Kernel wrappers pass ``interpret`` as read once when they were built (no per-call lookup).
    """
    return dtype == torch.bfloat16 and (interpreting() if interpret is None else interpret)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (and >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()
