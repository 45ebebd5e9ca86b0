"""The output side: what users get back (``RequestOutput`` and its parts, importable from here)
and how the engine core's per-step tokens become them (``processor``: detokenising, stop checks,
logprobs, the ``n`` samples of a request gathered).

The public types live in ``types`` and are re-exported here; the processing modules are imported
by path (``octavo.outputs.processor``), so importing ``octavo.outputs`` stays light."""

from octavo.outputs.types import (
    CompletionOutput,
    FinishReason,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
    StopReason,
)

__all__ = [
    "CompletionOutput",
    "FinishReason",
    "Logprob",
    "PromptLogprobs",
    "RequestMetrics",
    "RequestOutput",
    "SampleLogprobs",
    "StopReason",
]
