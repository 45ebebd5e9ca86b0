"""The EAGLE proposer: a trained head (``eagle_head``, EAGLE's of one decoder layer) drafts K
tokens serially from the target's hidden states.

The head's KV, like a draft model's, lives in caches of its own on the target's block ids
(sized, copied on write and swapped with the target's), so it needs no block manager of its
own. Its KV at position p encodes the target's hidden state at p and the token at p + 1, so a
position's KV can be written only once the token after it is known:

- after each target forward (``forward_step``) the head runs on the positions of the rows that
  do not sample (prompt chunks: the next tokens are the prompt's). For the rows that sample it
  keeps the target's hidden states (``head_backlog``): which of their positions are verified,
  and the token after the last one, are known only after sampling;
- ``propose`` runs the head once over each drafting row's kept verified positions, the newest
  token after the last one (one pass writes their KV, and its output at the last one predicts
  the first draft), then K - 1 single-token steps, each from the head's own prediction and
  draft, into the lookahead slots the scheduler allocated. A row that samples but does not
  draft (drafts are off: the adaptive policy, ``disable_by_batch_size``) keeps its positions,
  step after step, until it drafts again or the kept states of all rows pass
  ``MAX_BACKLOG_BYTES``; they are written in one pass then;
- a request that finishes with kept positions leaves them to ``PendingHeadKV``, by block:
  written only if a new request reads those blocks from the prefix cache, before its first
  head pass, and dropped when a block is computed again (most are never read: a pass over all
  of them at the finish cost 40-100 ms a batch of 16 on the demo model).

Draft positions hold the KV of drafts until computed again, as with a draft model; only drafts
depend on the head's KV, never the output (verification is lossless).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from octavo.model_executor.step_inputs import ragged_index
from octavo.models.layers.attention import Attention
from octavo.spec_decode.config import SpeculativeConfig
from octavo.spec_decode.drafting import (
    DraftDistributions,
    chunk_layout,
    chunk_metadata,
    drafter_config,
)
from octavo.spec_decode.eagle_head import EagleHead, check_eagle_head
from octavo.spec_decode.head_backlog import HeadBacklog, PendingHeadKV, Piece, Run
from octavo.spec_decode.proposer import ProposeContext

_NO_ROWS = np.zeros(0, dtype=np.int64)
MAX_BACKLOG_BYTES = 64 << 20  # kept hidden states past this are written even while drafts are off


@dataclasses.dataclass(frozen=True)
class VerifiedChunk:
    """Rows' positions ``first .. first + counts - 1`` whose tokens after them are known, with
    the target's hidden states there (``hidden [sum(counts), H]``, flat in row order)."""

    first: np.ndarray
    counts: np.ndarray
    hidden: torch.Tensor

    @property
    def last(self) -> np.ndarray:
        return self.first + self.counts - 1


class EagleProposer:
    """``speculative_config.method == "eagle"``."""

    needs_lookahead_slots = True
    recompute_last_cached_block = True  # its KV at a block's last position holds the next token

    def __init__(self, config: SpeculativeConfig, runner: Any):
        target = runner.model_config
        self.model_config, self.model = self.load_head(config, runner)
        self.model.attach(runner.model, runner.platform)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.runner = runner
        self.k = config.num_speculative_tokens
        self.block_size, self.device = runner.block_size, runner.device
        self.max_model_len = target.max_model_len
        self.distributions = DraftDistributions(
            target.vocab_size, self.k, self.device, runner.sampler
        )
        self.draft_probs = self.distributions.draft_probs
        # The sampling rows' positions with no head KV yet: those of their last step (which
        # are verified, and the token after the last one known, only after sampling), and
        # while drafts are off, every step's (module docstring of head_backlog).
        self._backlog = HeadBacklog()
        self.max_backlog = MAX_BACKLOG_BYTES // (target.hidden_size * target.dtype.itemsize)
        # Finished requests' kept positions, written only if a new request's prefix-cache hit
        # reads them (PendingHeadKV); the requests of the last step, to tell new rows.
        self._pending = PendingHeadKV(self.block_size, self.max_backlog)
        self._seen: set[str] = set()

    @staticmethod
    def load_head(config: SpeculativeConfig, runner: Any) -> tuple[Any, EagleHead]:
        """``(its ModelConfig, the head)``: the EAGLE head in ``config.model``, checked against
        the target."""
        model_config = drafter_config(config.model, runner)
        check_eagle_head(model_config, runner.model_config)
        return model_config, runner.load_model(model_config, EagleHead)

    def forward_step(self, step: Any, hidden_states: torch.Tensor) -> None:
        batch = self.runner.input_batch
        num_scheduled = step.num_scheduled.astype(np.int64)
        num_reqs = len(num_scheduled)
        first = batch.num_computed_tokens[:num_reqs].astype(np.int64) - num_scheduled
        starts = np.cumsum(num_scheduled) - num_scheduled
        if len(step.sample_rows) == num_reqs:  # every row samples (distinct rows: all of them)
            sampling_rows, others = np.arange(num_reqs), _NO_ROWS
        else:
            sampling = np.zeros(num_reqs, dtype=bool)
            sampling[step.sample_rows] = True
            sampling_rows, others = np.flatnonzero(sampling), np.flatnonzero(~sampling)
        req_ids = batch.req_ids[:num_reqs]
        if len(self._pending):
            new_rows = [r for r, req_id in enumerate(req_ids) if req_id not in self._seen]
            self._settle_pending(batch, first, num_scheduled, new_rows)
        self._seen = set(req_ids)
        self._trim_backlog(batch, first)
        # The sampling rows' kept positions wait for their next drafts, whose pass writes them;
        # a prompt chunk's (its row computed again after preemption) go before the chunk.
        capped = self._backlog.num_positions > self.max_backlog
        self._write_backlog(batch, np.arange(num_reqs) if capped else others)
        self._keep(batch, sampling_rows, starts, first, num_scheduled, hidden_states)
        if len(others):  # prompt chunks: the token after each position is the prompt's
            counts = num_scheduled[others]
            hidden = hidden_states.index_select(0, self._flat(starts[others], counts))
            self._chunk_pass(batch, others, VerifiedChunk(first[others], counts, hidden))

    def _keep(self, batch, rows, starts, first, num_scheduled, hidden_states) -> None:
        """The sampling rows' hidden states (a copy: a graph runner may reuse its output),
        until their verified positions are known."""
        if len(rows) == 0:
            return
        counts = num_scheduled[rows]
        if len(rows) == len(num_scheduled):  # every token is a sampling row's, in row order
            kept = hidden_states[: int(counts.sum())].clone()
        else:
            kept = hidden_states.index_select(0, self._flat(starts[rows], counts))
        kept_starts = (np.cumsum(counts) - counts).tolist()
        req_ids = batch.req_ids
        for i, r in enumerate(rows.tolist()):
            self._backlog.add(
                req_ids[r], Piece(kept, kept_starts[i], int(first[r]), int(counts[i]))
            )

    def _settle_pending(self, batch: Any, first, num_scheduled, new_rows: list[int]) -> None:
        """Finished requests' kept positions: dropped for the blocks this step computes again
        (reused), written for the blocks that rows new to the batch (admitted or resumed) read
        from the prefix cache, before any head pass of the step reads them."""
        bs = self.block_size
        lo, hi = first // bs, (first + num_scheduled - 1) // bs
        row, offset = ragged_index(hi - lo + 1)
        self._pending.drop(batch.block_table[row, lo[row] + offset].tolist())
        runs = {r: self._pending.pop(batch.block_table[r, : lo[r]].tolist()) for r in new_rows}
        self._write_runs(batch, runs)

    def _trim_backlog(self, batch: Any, first: np.ndarray) -> None:
        """Drop the step's rows' kept positions from the first one they compute on: those
        of their last step that were not verified (or all, when computed again)."""
        if not len(self._backlog):
            return
        req_ids = batch.req_ids
        for r in range(len(first)):
            if req_ids[r] in self._backlog:
                self._backlog.trim(req_ids[r], int(first[r]))

    def _write_backlog(self, batch: Any, rows: np.ndarray) -> None:
        """The head KV of every kept position of ``rows`` (trimmed: the tokens after them are
        known), no longer kept."""
        if not len(self._backlog):
            return
        req_ids = batch.req_ids
        runs = {int(r): self._backlog.pop(req_ids[r]) for r in rows if req_ids[r] in self._backlog}
        self._write_runs(batch, runs)

    def _write_runs(self, batch: Any, runs: dict[int, list[Run]]) -> None:
        """The head KV of each batch row's ``runs``: one pass for every row's first run, one
        more for the rows with a gap in their positions (rare), and so on."""
        runs = {r: rs for r, rs in runs.items() if rs}
        while runs:
            chunk = _one_run_a_row([rs[0] for rs in runs.values()])
            self._chunk_pass(batch, np.array(list(runs), dtype=np.int64), chunk)
            runs = {r: rs[1:] for r, rs in runs.items() if len(rs) > 1}

    def _take_verified(self, batch: Any, rows: np.ndarray) -> VerifiedChunk:
        """The kept positions of ``rows`` (which sampled this step), up to the one before the
        newest token, no longer kept: ``propose`` writes their KV in its pass. A row's positions
        before a gap, if any, are written first."""
        req_ids = batch.req_ids
        ends = batch.num_tokens[rows].astype(np.int64) - 1
        for r, end in zip(rows.tolist(), ends.tolist()):
            self._backlog.trim(req_ids[r], end)
        runs = [self._backlog.pop(req_ids[r]) for r in rows.tolist()]
        self._write_runs(batch, {r: rs[:-1] for r, rs in zip(rows.tolist(), runs)})
        return _one_run_a_row([rs[-1] for rs in runs])

    def _flat(self, starts: np.ndarray, counts: np.ndarray) -> torch.Tensor:
        row, offset = ragged_index(counts)
        return torch.from_numpy(starts[row] + offset).to(self.device)

    def _chunk_pass(self, batch: Any, rows: np.ndarray, chunk: VerifiedChunk, **kw):
        """One head pass over ``chunk``'s positions of ``rows``, each with the token after it
        in the batch: the predicted hidden states, their KV written."""
        row, positions = layout = chunk_layout(chunk.first, chunk.counts)
        tokens = batch.token_ids[rows[row], positions + 1].astype(np.int64)
        attn = chunk_metadata(
            batch, rows, chunk.first, chunk.counts, self.block_size, self.device, layout
        )
        return self.model(
            torch.from_numpy(tokens).to(self.device),
            chunk.hidden,
            torch.from_numpy(positions).to(self.device),
            attn,
            **kw,
        )

    def _head_step(self, batch: Any, rows: np.ndarray, positions: np.ndarray, hidden):
        """One head step per row at ``positions`` (its token after is in the batch)."""
        ones = np.ones(len(rows), dtype=np.int64)
        return self._chunk_pass(batch, rows, VerifiedChunk(positions, ones, hidden))

    def propose(self, context: ProposeContext) -> tuple[np.ndarray, np.ndarray]:
        batch, rows = context.batch, context.rows
        newest = batch.num_tokens[rows].astype(np.int64) - 1  # the newest token: no KV yet
        num_drafts = np.maximum(np.minimum(self.k, self.max_model_len - 1 - newest), 0)
        verified = self._take_verified(batch, rows)
        drafts = np.zeros((len(rows), self.k), dtype=np.int64)
        probs = self.distributions.new_probs(batch, rows)
        self._draft(context, verified, num_drafts, drafts, probs)
        self.distributions.keep(batch, rows, num_drafts, probs)
        return drafts, num_drafts

    def _draft(self, context, verified: VerifiedChunk, num_drafts, drafts, probs) -> None:
        """Fill ``drafts [R, K]`` (and ``probs``) for ``context.rows``: the pass over their
        verified positions, then K - 1 serial head steps."""
        if self._greedy_at_once(context, verified, num_drafts, drafts, probs, self.k) is not None:
            return
        predicted = self._verified_pass(context, verified)
        self._draft_serially(context, verified.last, predicted, num_drafts, drafts, probs, self.k)

    def _verified_pass(self, context, verified: VerifiedChunk) -> torch.Tensor:
        """The head pass over the rows' verified positions: ``[R, H]`` its predictions at each
        row's last one (the hidden states the first drafts are scored from)."""
        predicted = self._chunk_pass(context.batch, context.rows, verified)
        last = torch.from_numpy(np.cumsum(verified.counts) - 1).to(self.device)
        return predicted.index_select(0, last)

    def _draft_serially(self, context, positions, predicted, num_drafts, drafts, probs, steps):
        """Drafts ``0 .. steps - 1``: the first from ``predicted`` (the head's predictions at
        ``positions``, each row's last verified one), each next one from a head step on the
        last one's prediction and draft; returns the rows (indices into ``context.rows``) that
        drafted them all and the head's predictions their last drafts were scored from."""
        batch, rows = context.batch, context.rows
        active, hidden = np.arange(len(rows)), predicted
        for j in range(steps):
            keep = num_drafts[active] > j
            if not keep.all():  # rows near max_model_len draft fewer
                active, hidden = active[keep], hidden[torch.from_numpy(keep).to(self.device)]
            if len(active) == 0:
                break
            at = positions[active] + j
            if j > 0:
                hidden = self._head_step(batch, rows[active], at, hidden)
            depth = np.zeros(len(active), dtype=np.int64)
            self._sample_in_order(context, active, depth, j, at, hidden, drafts, probs)
        return active, hidden

    def _greedy_at_once(
        self, context, verified, num_drafts, drafts, probs, steps, parallel=False, mlp_drafts=0
    ):
        """The pass over the rows' verified positions and their first ``steps`` drafts, serial
        or ``parallel`` (P-EAGLE's), and ``mlp_drafts`` more from a Gumiho head's MLP heads, in
        the head's one call (``greedy_head_drafts``: the same kernels, without the interpreter
        between them), where the platform has one, every row is greedy with no logits
        processor and drafts them all: ``(every row, the predictions their last serial (or
        parallel) drafts were scored from)``; else None."""
        if context.process_logits is not None or probs is not None:
            return None
        one_call = self.model.one_call("greedy_head_drafts")
        count = steps + mlp_drafts
        if one_call is None or not (num_drafts >= count).all():
            return None
        batch, rows = context.batch, context.rows
        block, hidden = one_call(
            verified.hidden,
            torch.from_numpy(rows.astype(np.int64)),
            torch.from_numpy(verified.first),
            torch.from_numpy(verified.counts),
            steps,
            parallel,
            torch.from_numpy(batch.token_ids),
            torch.from_numpy(batch.block_table),
            self.block_size,
            mlp_drafts=mlp_drafts,
        )
        block = block.cpu().numpy()
        drafts[:, :count] = block
        batch.token_ids[rows[:, None], verified.last[:, None] + 2 + np.arange(count)] = block
        return np.arange(len(rows)), hidden

    def _sample_in_order(self, context, active, depth, first_j: int, at, hidden, drafts, probs):
        """Drafts ``first_j + depth[i]`` of rows ``active[i]`` (indices into ``context.rows``)
        at positions ``at[i]`` from the head's predictions ``hidden [N, H]`` (one row each),
        scored at once, sampled depth by depth so that each one's logits processors see the
        drafts before it; where no processor adjusts the rows and every one is greedy (no
        ``probs`` to fill), the argmax of each row's logits (the head's ``greedy_drafts``)."""
        if context.process_logits is None and probs is None:
            sampled = self.model.greedy_drafts(hidden, self.distributions.argmax)
            drafts[active, first_j + depth] = sampled
            context.batch.token_ids[context.rows[active], at + 2] = sampled
            return
        logits = self.model.compute_logits(hidden)
        for j in range(int(depth.max(initial=-1)) + 1):
            here = np.flatnonzero(depth == j)
            index = torch.from_numpy(here).to(self.device)
            self._sample_logits(
                context, active[here], first_j + j, at[here], logits[index], drafts, probs
            )

    def _sample_logits(self, context, active, j: int, at, logits, drafts, probs) -> None:
        """Draft ``j`` of the rows ``active`` (indices into ``context.rows``) at positions
        ``at`` from the head's logits there."""
        batch, rows = context.batch, context.rows
        logits = logits.float()
        if context.process_logits is not None:  # a failed processing: only a worse draft
            logits = context.process_logits(logits, rows[active], at + 2, {})
        sampled, q = self.distributions.sample(logits, batch, rows[active])
        drafts[active, j] = sampled
        batch.token_ids[rows[active], at + 2] = sampled  # the next step's token, and seen by
        if probs is not None:  # the processors
            probs[torch.from_numpy(active).to(self.device), j] = q

    def forget(self, req_ids) -> None:
        """Finished requests (their rows still in the batch): the positions of their last step,
        never verified, are dropped; their kept verified positions wait in ``PendingHeadKV``
        for a prefix-cache hit on their blocks, or are written now where a running request
        shares one of those blocks (it reads them from its next draft on)."""
        self.distributions.forget(req_ids)
        batch = self.runner.input_batch
        kept = {}
        for req_id in req_ids:
            row = batch.req_id_to_index.get(req_id)
            if req_id in self._backlog and row is not None:
                self._backlog.drop_newest(req_id)
                kept[row] = self._backlog.pop(req_id)
        self._backlog.forget(req_ids)
        shared = self._shared_rows(batch, kept)
        self._write_runs(batch, {r: runs for r, runs in kept.items() if r in shared})
        for r, runs in kept.items():
            if r not in shared:
                self._pending.add(batch.block_table[r, : batch.num_blocks[r]].tolist(), runs)

    @staticmethod
    def _shared_rows(batch: Any, kept: dict[int, list[Run]]) -> set[int]:
        """The rows of ``kept`` with a block that a row outside ``kept`` also holds."""
        if not kept:
            return set()
        live = np.setdiff1d(np.arange(batch.num_reqs), np.fromiter(kept, np.int64))
        if not len(live):
            return set()
        num_cols = int(batch.num_blocks[: batch.num_reqs].max())
        held = batch.block_table[live, :num_cols]
        held = held[np.arange(num_cols) < batch.num_blocks[live][:, None]]
        return {r for r in kept if np.isin(batch.block_table[r, : batch.num_blocks[r]], held).any()}


def _one_run_a_row(runs: list[Run]) -> VerifiedChunk:
    """The chunk of one run of kept positions per row, in row order."""
    hidden = [h for run in runs for h in run.hidden]
    return VerifiedChunk(
        np.array([run.first for run in runs], dtype=np.int64),
        np.array([run.count for run in runs], dtype=np.int64),
        hidden[0] if len(hidden) == 1 else torch.cat(hidden),
    )
