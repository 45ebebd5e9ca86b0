"""The EAGLE proposer: a trained one-layer head (``eagle_head``) drafts K tokens serially from
the target's hidden states.

The head's KV, like a draft model's, lives in caches of its own on the target's block ids
(sized, copied on write and swapped with the target's), so it needs no block manager of its
own. Its KV at position p encodes the target's hidden state at p and the token at p + 1:

- after each target forward (``forward_step``) it runs on the step's flat batch, each position
  with the next token in the batch (the next prompt token, or the draft being verified). A
  row's last verified position has no next token yet; that KV is written once the token is
  sampled: by ``propose`` (its first draft step starts there) for the rows drafting, else
  at the start of the row's next step from the hidden state kept for it;
- ``propose`` then runs K single-token steps per drafting row, each from the head's own
  prediction and draft, into the lookahead slots the scheduler allocated.

A position whose next token was a rejected draft holds a wrong KV until the position is
computed again, as with a draft model; only drafts depend on the head's KV, never the output
(verification is lossless).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from octavo.model_executor.step_inputs import ragged_index
from octavo.models.layers.attention import Attention
from octavo.spec_decode.config import SpeculativeConfig
from octavo.spec_decode.drafting import DraftDistributions, decode_metadata, drafter_config
from octavo.spec_decode.eagle_head import EagleHead, check_eagle_head
from octavo.spec_decode.proposer import ProposeContext


class EagleProposer:
    """``speculative_config.method == "eagle"``."""

    needs_lookahead_slots = True
    recompute_last_cached_block = True  # its KV at a block's last position holds the next token

    def __init__(self, config: SpeculativeConfig, runner: Any):
        target = runner.model_config
        self.model_config, self.model = self.load_head(config, runner)
        self.model.attach(runner.model)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.runner = runner
        self.k = config.num_speculative_tokens
        self.block_size, self.device = runner.block_size, runner.device
        self.max_model_len = target.max_model_len
        self.distributions = DraftDistributions(target.vocab_size, self.k, self.device)
        self.draft_probs = self.distributions.draft_probs
        # Per sampling request of the last step: (where its hidden states start in
        # _last_hidden, its first position in the step, how many positions).
        self._last_step: dict[str, tuple[int, int, int]] = {}
        self._last_hidden: Any = None
        self._written: set[str] = set()  # requests whose last verified position propose wrote

    @staticmethod
    def load_head(config: SpeculativeConfig, runner: Any) -> tuple[Any, EagleHead]:
        """``(its ModelConfig, the head)``: the EAGLE head in ``config.model``, checked against
        the target."""
        model_config = drafter_config(config.model, runner)
        check_eagle_head(model_config, runner.model_config)
        return model_config, runner.load_model(model_config, EagleHead)

    def forward_step(self, step: Any, hidden_states: torch.Tensor) -> None:
        batch = self.runner.input_batch
        num_scheduled = step.num_scheduled
        num_reqs = len(num_scheduled)
        first = batch.num_computed_tokens[:num_reqs].astype(np.int64) - num_scheduled
        self._write_last_verified(batch, first)
        row, offset = ragged_index(num_scheduled)
        positions = first[row] + offset
        next_positions = np.minimum(positions + 1, batch.token_ids.shape[1] - 1)
        next_tokens = torch.from_numpy(batch.token_ids[row, next_positions].astype(np.int64))
        self.model(next_tokens.to(self.device), hidden_states, step.positions, step.attn_metadata)
        self._keep_sampling_rows(batch, step, first, hidden_states)

    def _keep_sampling_rows(self, batch, step, first: np.ndarray, hidden_states) -> None:
        """The sampling rows' hidden states (a copy: a graph runner may reuse its output), for
        the KV of their last verified position once its next token is known."""
        rows = step.sample_rows
        counts = step.num_scheduled[rows].astype(np.int64)
        starts = np.cumsum(step.num_scheduled) - step.num_scheduled
        row, offset = ragged_index(counts)
        index = torch.from_numpy(starts[rows][row] + offset).to(self.device)
        self._last_hidden = hidden_states.index_select(0, index)
        kept_starts = np.cumsum(counts) - counts
        req_ids = batch.req_ids
        self._last_step = {
            req_ids[r]: (int(kept_starts[i]), int(first[r]), int(counts[i]))
            for i, r in enumerate(rows.tolist())
        }
        self._written = set()

    def _write_last_verified(self, batch: Any, first: np.ndarray) -> None:
        """The KV of each row's position before its first one this step (the last verified
        position of its previous step), now that the token after it is known, where
        ``propose`` did not write it."""
        rows, flat = [], []
        req_ids = batch.req_ids
        for r in range(len(first)):
            kept = self._last_step.get(req_ids[r])
            if kept is None or req_ids[r] in self._written:
                continue
            start, prev_first, count = kept
            position = int(first[r]) - 1
            if prev_first <= position < prev_first + count:
                rows.append(r)
                flat.append(start + position - prev_first)
        if not rows:
            return
        rows_np = np.array(rows)
        positions = first[rows_np] - 1
        hidden = self._last_hidden.index_select(0, torch.tensor(flat, device=self.device))
        self._head_step(batch, rows_np, positions, hidden)

    def _head_step(self, batch: Any, rows: np.ndarray, positions: np.ndarray, hidden):
        """One head step per row at ``positions`` (its token after is in the batch): the
        predicted hidden states, its KV written."""
        tokens = batch.token_ids[rows, positions + 1].astype(np.int64)
        attn = decode_metadata(batch, rows, positions, self.block_size, self.device)
        return self.model(
            torch.from_numpy(tokens).to(self.device),
            hidden,
            torch.from_numpy(positions).to(self.device),
            attn,
        )

    def propose(self, context: ProposeContext) -> tuple[np.ndarray, np.ndarray]:
        batch, rows = context.batch, context.rows
        newest = batch.num_tokens[rows].astype(np.int64) - 1  # the newest token: no KV yet
        num_drafts = np.clip(np.minimum(self.k, self.max_model_len - 1 - newest), 0, None)
        req_ids = batch.req_ids
        flat = [self._flat_index(req_ids[r], int(p) - 1) for r, p in zip(rows.tolist(), newest)]
        hidden = self._last_hidden.index_select(0, torch.tensor(flat, device=self.device))
        positions = newest - 1  # each row's last verified position
        drafts = np.zeros((len(rows), self.k), dtype=np.int64)
        probs = self.distributions.new_probs(batch, rows)
        self._draft(context, positions, hidden, num_drafts, drafts, probs)
        self._written.update(req_ids[r] for r in rows[num_drafts > 0].tolist())
        self.distributions.keep(batch, rows, num_drafts, probs)
        return drafts, num_drafts

    def _draft(self, context, positions, hidden, num_drafts, drafts, probs) -> None:
        """Fill ``drafts [R, K]`` (and ``probs``) for ``context.rows``: K serial head steps."""
        self._draft_serially(context, positions, hidden, num_drafts, drafts, probs, self.k)

    def _draft_serially(self, context, positions, hidden, num_drafts, drafts, probs, steps):
        """Drafts ``0 .. steps - 1``, each head step from the last one's prediction and draft;
        returns the rows (indices into ``context.rows``) that drafted them all and the head's
        last predicted hidden states for them."""
        batch, rows = context.batch, context.rows
        active = np.arange(len(rows))
        for j in range(steps):
            keep = num_drafts[active] > j
            active, hidden = active[keep], hidden[torch.from_numpy(keep).to(self.device)]
            if len(active) == 0:
                break
            at = positions[active] + j
            hidden = self._head_step(batch, rows[active], at, hidden)
            logits = self.model.compute_logits(hidden)
            self._sample_logits(context, active, j, at, logits, drafts, probs)
        return active, hidden

    def _sample_logits(self, context, active, j: int, at, logits, drafts, probs) -> None:
        """Draft ``j`` of the rows ``active`` (indices into ``context.rows``) at positions
        ``at`` from the head's logits there."""
        batch, rows = context.batch, context.rows
        logits = logits.float()
        if context.process_logits is not None:  # a failed processing: only a worse draft
            logits = context.process_logits(logits, rows[active], at + 2, {})
        sampled, q = self.distributions.sample(logits, batch.sampling_metadata(rows[active]))
        drafts[active, j] = sampled
        batch.token_ids[rows[active], at + 2] = sampled  # the next step's token, and seen by
        if probs is not None:  # the processors
            probs[torch.from_numpy(active).to(self.device), j] = q

    def _flat_index(self, req_id: str, position: int) -> int:
        start, first, _ = self._last_step[req_id]
        return start + position - first

    def forget(self, req_ids) -> None:
        self.distributions.forget(req_ids)
        for req_id in req_ids:
            self._last_step.pop(req_id, None)
