"""octavo: an LLM inference and serving engine with per-vendor platform plugins."""

import os
import sys

if "torch" not in sys.modules:
    # OpenMP reads this once, when torch loads it. Its default (active) lets idle threads spin:
    # when anything else wants a core (the server's event loop, a benchmark client, another
    # job) every parallel region then waits for a descheduled spinner, and a 2-core host ran the
    # tiny model 6x slower on two threads than on one. Passive threads sleep. The environment
    # wins: OMP_WAIT_POLICY=ACTIVE restores spinning; `octavo env` shows the setting.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LoRARequest",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
    "hookimpl",
    "hookspec",
    "__version__",
]


def __getattr__(name: str):
    # Lazy: ``import octavo`` loads nothing (torch included) until a name is used, so the
    # OpenMP setting above comes first; plugins importing ``hookimpl`` get the contract
    # (``octavo.platform``), never the engine.
    if name in ("hookimpl", "hookspec"):
        from octavo.platform import hookspecs

        return getattr(hookspecs, name)
    if name == "LLM":
        from octavo.entrypoints.llm import LLM

        return LLM
    if name in ("TextPrompt", "TokensPrompt"):
        from octavo import inputs

        return getattr(inputs, name)
    if name == "LoRARequest":
        from octavo.lora.request import LoRARequest

        return LoRARequest
    if name == "SamplingParams":
        from octavo.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'octavo' has no attribute {name!r}")
