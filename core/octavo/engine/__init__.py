"""The engine's output side: detokenisation, stop conditions, logprobs and RequestOutputs."""

from octavo.engine.detokenizer import IncrementalDetokenizer, TokenizerAdapter
from octavo.engine.logprobs import StepLogprobs
from octavo.engine.output_processor import (
    ChildRequest,
    EngineCoreOutput,
    OutputProcessor,
    ProcessedOutputs,
)
from octavo.engine.stop_checker import FinishReason, StopChecker

__all__ = [
    "ChildRequest",
    "EngineCoreOutput",
    "FinishReason",
    "IncrementalDetokenizer",
    "OutputProcessor",
    "ProcessedOutputs",
    "StepLogprobs",
    "StopChecker",
    "TokenizerAdapter",
]
