"""Log-probabilities from the model runner (``StepLogprobs``) turned into vLLM-style
per-position dicts."""

from __future__ import annotations

from typing import Any, Optional

from octavo.model_executor.runner_output import StepLogprobs
from octavo.outputs.detokenizer import TokenizerAdapter
from octavo.outputs.types import Logprob


def _as_list(values: Any) -> list:
    # numpy arrays and torch tensors convert in one call; lists pass through.
    return values.tolist() if hasattr(values, "tolist") else list(values)


def build_logprob_dicts(
    step: StepLogprobs,
    num_top: int,
    adapter: Optional[TokenizerAdapter],
    num_rows: Optional[int] = None,
) -> tuple[list[dict[int, Logprob]], list[float]]:
    """Per-position ``{token_id: Logprob}`` (chosen token first, then the top ``num_top``) and the
    chosen tokens' logprobs, for the first ``num_rows`` rows (all by default).

    A chosen token that is also among the top alternatives appears once, with its own rank.
    """
    token_rows = _as_list(step.token_ids)[:num_rows]
    logprob_rows = _as_list(step.logprobs)[:num_rows]
    ranks = _as_list(step.ranks)[:num_rows]
    token_rows = [row[: num_top + 1] for row in token_rows]
    decoded = _decode_rows(token_rows, adapter)
    dicts = []
    for row_ids, row_logprobs, rank, row_text in zip(token_rows, logprob_rows, ranks, decoded):
        position = {row_ids[0]: Logprob(row_logprobs[0], rank, row_text[0])}
        for top_rank in range(1, len(row_ids)):
            if row_ids[top_rank] not in position:
                position[row_ids[top_rank]] = Logprob(
                    row_logprobs[top_rank], top_rank, row_text[top_rank]
                )
        dicts.append(position)
    chosen = [row[0] for row in logprob_rows]
    return dicts, chosen


def _decode_rows(
    token_rows: list[list[int]], adapter: Optional[TokenizerAdapter]
) -> list[list[Optional[str]]]:
    if adapter is None:
        return [[None] * len(row) for row in token_rows]
    flat = adapter.decode_each([token_id for row in token_rows for token_id in row])
    rows, offset = [], 0
    for row in token_rows:
        rows.append(flat[offset : offset + len(row)])
        offset += len(row)
    return rows
