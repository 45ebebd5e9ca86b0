"""Where the tpu platform computes: on a TPU, or in Pallas interpret mode on JAX's CPU backend.

``OCTAVO_PALLAS_INTERPRET=1`` (the counterpart of ``OCTAVO_TRITON_INTERPRET_DEVICE`` for the
Triton platforms) makes the platform available on any host with jax: its Pallas kernels run
with ``interpret=True`` and the JAX runner on the CPU backend, so everything can be checked
without a TPU. It is read once, at detection; the runner and the kernels take it as an
argument from there.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Optional

INTERPRET_ENV = "OCTAVO_PALLAS_INTERPRET"


def interpreting() -> bool:
    """True when asked to run the Pallas kernels interpreted on the CPU."""
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0")


def why_unavailable(interpret: bool) -> Optional[str]:
    """None when the platform can run here, else the reason. Never starts a TPU client: only
    installed packages and device files are looked at."""
    if importlib.util.find_spec("jax") is None:
        return "jax is not installed (pip install octavo[tpu])"
    if interpret:
        return None
    hint = f"; to run it on the CPU in Pallas interpret mode set {INTERPRET_ENV}=1"
    if importlib.util.find_spec("libtpu") is None:
        return "libtpu is not installed: no TPU runtime (pip install 'jax[tpu]')" + hint
    if not (
        glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or os.environ.get("TPU_NAME")
    ):
        return "no TPU device found (/dev/accel* or /dev/vfio/*)" + hint
    return None


def reason(interpret: bool) -> str:
    """The detection reason of an available platform."""
    if interpret:
        return (
            f"Pallas interpret mode on JAX's CPU backend ({INTERPRET_ENV}=1); kernels are "
            "checked, not fast"
        )
    return "TPU device files and libtpu present"


def jax_device(interpret: bool):
    """The JAX device the runner computes on: the first TPU core, or the CPU when
    interpreting."""
    import jax

    return jax.devices("cpu" if interpret else "tpu")[0]
