"""Helpers for platform plugins whose kernels are still to come."""

from __future__ import annotations

from octavo.errors import KernelNotAvailableError


def kernel_pending(platform_name: str, kernel: str, where: str) -> KernelNotAvailableError:
    """The error a platform raises for a kernel it does not provide yet, saying what to do
    (the platforms to choose instead are the ones detection found: ``octavo env`` lists them)."""
    return KernelNotAvailableError(
        f"the {platform_name} platform has no {kernel} kernel yet ({where}); "
        f"run on another platform with --device NAME (`octavo env` lists those available here)"
    )
