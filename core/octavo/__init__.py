"""octavo: an LLM inference and serving engine with per-vendor platform plugins."""

from octavo.hookspecs import hookimpl, hookspec

__version__ = "0.1.0"

__all__ = ["hookimpl", "hookspec", "__version__"]
