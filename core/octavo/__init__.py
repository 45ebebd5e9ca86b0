"""octavo: an LLM inference and serving engine with per-vendor platform plugins."""

from octavo.hookspecs import hookimpl, hookspec

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "hookimpl", "hookspec", "__version__"]


def __getattr__(name: str):
    # Lazy: plugins import ``octavo`` for ``hookimpl`` and must not pay for the engine's imports.
    if name == "LLM":
        from octavo.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from octavo.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'octavo' has no attribute {name!r}")
