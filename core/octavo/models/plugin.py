"""Registers the core's model architectures through the same hook a model plugin uses."""

from __future__ import annotations

from octavo import hookimpl


@hookimpl
def octavo_model_architectures():
    # Filled in by the model-execution issue (Llama, Mistral, Qwen2, Qwen3).
    return {}
