"""The cpu platform's compiled kernels: which library runs, chosen once by what the CPU reports.

``setup.py`` builds one library per instruction set (``_C_avx512``: AVX-512 with BF16;
``_C_avx2``: AVX2 + FMA). ``load_kernels()`` loads the best one this CPU can run, or none: then
the platform runs its torch path, and ``CpuKernels.reason`` says why (``octavo env`` prints it).
``OCTAVO_CPU_KERNELS`` forces a choice: ``avx512``, ``avx2`` or ``torch`` (no compiled kernels).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch

from octavo_cpu.fake_ops import register_fakes

KERNELS_ENV = "OCTAVO_CPU_KERNELS"
ISAS = ("avx512", "avx2")  # best first
_REQUIRED_FLAGS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni", "fma"),
    "avx2": ("avx2", "fma", "f16c"),
}
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CpuKernels:
    """The compiled kernels in use (``ops`` None: the torch path) and why this choice."""

    isa: Optional[str]
    ops: Any
    reason: str

    @property
    def path(self) -> str:
        """``"compiled (avx512)"`` or ``"torch"``, for reports."""
        return f"compiled ({self.isa})" if self.ops is not None else "torch"


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags the kernel reports for this CPU (Linux), else none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def supported_isas(flags: frozenset[str]) -> list[str]:
    """The libraries this CPU can run, best first."""
    return [isa for isa in ISAS if all(f in flags for f in _REQUIRED_FLAGS[isa])]


@functools.lru_cache(maxsize=None)
def load_kernels() -> CpuKernels:
    """The compiled kernels for this CPU (loaded once per process)."""
    kernels = _load(os.environ.get(KERNELS_ENV, "").strip().lower())
    logger.info("cpu kernels: %s (%s)", kernels.path, kernels.reason)
    return kernels


def _load(forced: str) -> CpuKernels:
    if forced == "torch":
        return CpuKernels(None, None, f"{KERNELS_ENV}=torch")
    if forced and forced not in ISAS:
        raise ValueError(f"{KERNELS_ENV}={forced!r}: use one of {', '.join((*ISAS, 'torch'))}")
    runnable = supported_isas(cpu_flags())
    if forced and forced not in runnable:
        raise ValueError(
            f"{KERNELS_ENV}={forced} but this CPU lacks {forced}'s instructions "
            f"(it can run: {', '.join(runnable) or 'none'}); unset it or pick another"
        )
    candidates = [forced] if forced else runnable
    if not candidates:
        return CpuKernels(None, None, "this CPU has neither AVX-512 (with BF16) nor AVX2")
    missing = []
    for isa in candidates:
        library = _library_path(isa)
        if library is None:
            missing.append(isa)
            continue
        torch.ops.load_library(str(library))
        register_fakes(f"octavo_cpu_{isa}")
        why = f"{KERNELS_ENV}={forced}" if forced else "the best this CPU runs"
        return CpuKernels(isa, getattr(torch.ops, f"octavo_cpu_{isa}"), why)
    return CpuKernels(
        None,
        None,
        f"no compiled library for {', '.join(missing)} is installed (the build was skipped or "
        "failed: reinstall octavo-cpu with a C++ compiler to get them)",
    )


def _library_path(isa: str) -> Optional[Path]:
    folder = Path(__file__).resolve().parent
    matches = sorted(folder.glob(f"_C_{isa}*.so"))
    return matches[0] if matches else None
