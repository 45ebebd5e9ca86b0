"""Beam search on the engine: every live beam is a one-token request, and prefix caching lets
the beams share their common prefix's KV blocks (a beam that dies frees its blocks at once)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from octavo.sampling_params import SamplingParams

if TYPE_CHECKING:
    from octavo.entrypoints.llm import LLM


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """``beam_width`` beams, ``max_tokens`` new tokens, HuggingFace's length penalty."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")


@dataclasses.dataclass(frozen=True)
class BeamSequence:
    """One hypothesis: all its tokens (prompt included), its output text and its score."""

    tokens: tuple[int, ...]
    cum_logprob: float
    num_prompt_tokens: int
    finished: bool = False
    text: Optional[str] = None

    @property
    def output_token_ids(self) -> list[int]:
        return list(self.tokens[self.num_prompt_tokens :])


@dataclasses.dataclass(frozen=True)
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first."""

    sequences: list[BeamSequence]


def beam_score(seq: BeamSequence, length_penalty: float) -> float:
    """HuggingFace's score: cumulative logprob over output length to the ``length_penalty``."""
    return seq.cum_logprob / (max(len(seq.tokens) - seq.num_prompt_tokens, 1) ** length_penalty)


def beam_search_one(
    llm: "LLM", prompt_token_ids: list[int], params: BeamSearchParams
) -> BeamSearchOutput:
    """Keep the ``beam_width`` best continuations each step among the top ``2 * beam_width``
    tokens of every live beam; finished beams (EOS) are set aside and ranked at the end."""
    width = params.beam_width
    eos_ids = set(llm.engine.model_config.eos_token_ids)
    step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
    beams = [BeamSequence(tuple(prompt_token_ids), 0.0, len(prompt_token_ids))]
    finished: list[BeamSequence] = []
    for _ in range(params.max_tokens):
        outputs = llm.generate(
            [{"prompt_token_ids": list(b.tokens)} for b in beams], step_params, use_tqdm=False
        )
        candidates = []
        for beam, output in zip(beams, outputs):
            for token_id, logprob in output.outputs[0].logprobs[0].items():
                candidates.append(
                    BeamSequence(
                        beam.tokens + (token_id,),
                        beam.cum_logprob + logprob.logprob,
                        beam.num_prompt_tokens,
                    )
                )
        candidates.sort(key=lambda seq: seq.cum_logprob, reverse=True)
        beams = []
        for seq in candidates:
            if not params.ignore_eos and seq.tokens[-1] in eos_ids:
                finished.append(dataclasses.replace(seq, finished=True))
            else:
                beams.append(seq)
            if len(beams) == width:
                break
        if not beams:
            break
    ranked = sorted(
        finished + beams, key=lambda seq: beam_score(seq, params.length_penalty), reverse=True
    )[:width]
    tokenizer = llm.engine.tokenizer
    return BeamSearchOutput(
        [dataclasses.replace(seq, text=tokenizer.decode(seq.output_token_ids)) for seq in ranked]
    )
