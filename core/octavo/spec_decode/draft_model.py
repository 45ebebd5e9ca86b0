"""The draft-model proposer: a smaller model of the target's tokenizer proposes K tokens.

Its KV lives in caches of its own that share the target's block ids, block tables and slot
mapping (its layers are part of the runner's KV caches, so they are sized, copied on write and
swapped with the target's). Each step it first runs on the step's own tokens, the same flat
batch as the target, so its KV follows every prefill chunk and every verified position; a
rejected draft's slot is written again when the position next holds a token. After
verification it decodes K tokens from each request's newest token, one batched single-token
forward per draft, into the lookahead slots the scheduler allocated (``num_lookahead_tokens``).

Drafts are sampled from the draft model's distribution under the request's own temperature,
top-k, top-p and min-p (greedy requests take its argmax); those probabilities are kept for the
verifier's accept test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from octavo.models.layers.attention import Attention
from octavo.spec_decode.config import SpeculativeConfig, check_draft_model
from octavo.spec_decode.drafting import DraftDistributions, decode_metadata, drafter_config
from octavo.spec_decode.proposer import ProposeContext

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")


def tokenizer_files(folder: Path) -> dict[str, bytes]:
    """The bytes of the tokenizer files a model folder holds (those that define the vocabulary)."""
    return {
        name: (folder / name).read_bytes() for name in TOKENIZER_FILES if (folder / name).is_file()
    }


class DraftModelProposer:
    """``speculative_config.method == "draft_model"``."""

    needs_lookahead_slots = True
    recompute_last_cached_block = False

    def __init__(self, config: SpeculativeConfig, runner: Any):
        target = runner.model_config
        self.model_config = drafter_config(config.model, runner)
        check_draft_model(
            self.model_config.vocab_size,
            target.vocab_size,
            tokenizer_files(self.model_config.model_path),
            tokenizer_files(target.model_path),
        )
        self.model, self.forward = runner.build_model(self.model_config)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.k = config.num_speculative_tokens
        self.block_size = runner.block_size
        self.device = runner.device
        self.max_model_len = target.max_model_len
        self.distributions = DraftDistributions(
            self.model_config.vocab_size, self.k, self.device, runner.sampler
        )
        self.draft_probs = self.distributions.draft_probs
        self.forget = self.distributions.forget

    def forward_step(self, step: Any, hidden_states: torch.Tensor) -> None:
        """Write the draft's KV for the step's tokens (the target's flat batch)."""
        self.forward(step.input_ids, step.positions, step.attn_metadata)

    def propose(self, context: ProposeContext) -> tuple[np.ndarray, np.ndarray]:
        batch, rows = context.batch, context.rows
        positions = batch.num_tokens[rows].astype(np.int64) - 1  # the newest token: no KV yet
        num_drafts = np.clip(np.minimum(self.k, self.max_model_len - 1 - positions), 0, None)
        tokens = batch.token_ids[rows, positions].astype(np.int64)
        drafts = np.zeros((len(rows), self.k), dtype=np.int64)
        probs = self.distributions.new_probs(batch, rows)
        active = np.arange(len(rows))
        for j in range(self.k):
            active = active[num_drafts[active] > j]
            if len(active) == 0:
                break
            position = positions[active] + j
            sampled, q = self._decode_one(
                batch, rows[active], tokens[active], position, context.process_logits
            )
            tokens[active] = sampled
            drafts[active, j] = sampled
            batch.token_ids[rows[active], position + 1] = sampled  # seen by the processors
            if probs is not None:
                probs[torch.from_numpy(active).to(self.device), j] = q
        self.distributions.keep(batch, rows, num_drafts, probs)
        return drafts, num_drafts

    def _decode_one(self, batch, rows, tokens, positions, process_logits):
        """One single-token forward for batch rows ``rows`` (their tokens ``tokens`` at
        ``positions``): their next drafts and the draft's probabilities for them (0 for greedy
        rows), after the request's own logits processors."""
        device = self.device
        attn = decode_metadata(batch, rows, positions, self.block_size, device)
        hidden = self.forward(
            torch.from_numpy(tokens).to(device), torch.from_numpy(positions).to(device), attn
        )
        logits = self.model.compute_logits(hidden).float()
        if process_logits is not None:  # a draft whose processing fails is only a worse draft
            logits = process_logits(logits, rows, positions + 1, {})
        return self.distributions.sample(logits, batch, rows)
