"""The runner's side of speculative decoding: the scheduled drafts placed after each request's
tokens, their verification once the target has scored them, and the next step's proposals."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from octavo.errors import ConfigError
from octavo.model_executor.logprobs import emitted_logprobs
from octavo.model_executor.step_inputs import ragged_index
from octavo.platform.types import RejectionSamplerFn
from octavo.spec_decode.config import SpeculativeConfig
from octavo.spec_decode.draft_model import DraftModelProposer
from octavo.spec_decode.eagle import EagleProposer
from octavo.spec_decode.gumiho import GumihoProposer
from octavo.spec_decode.mtp import MtpProposer
from octavo.spec_decode.ngram import NgramProposer
from octavo.spec_decode.p_eagle import ParallelEagleProposer
from octavo.spec_decode.proposer import ProposeContext, Proposer
from octavo.spec_decode.verifier import DraftVerifier, positions_per_row

if TYPE_CHECKING:
    from octavo.model_executor.input_batch import InputBatch
    from octavo.model_executor.step_inputs import StepInputs


def make_proposer(config: SpeculativeConfig, runner: Any) -> Proposer:
    """The proposer ``config.method`` names, built for ``runner`` (a ModelRunner)."""
    if config.method == "ngram":
        return NgramProposer(
            config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens
        )
    if config.method == "draft_model":
        return DraftModelProposer(config, runner)
    if config.method == "eagle":
        if config.parallel_drafting:
            return ParallelEagleProposer(config, runner)
        return EagleProposer(config, runner)
    if config.method == "gumiho":
        return GumihoProposer(config, runner)
    if config.method == "mtp":
        return MtpProposer(config, runner)
    raise ConfigError(f"speculative_config.method {config.method!r} has no proposer")


class Speculation:
    """Drafts in, verified tokens and new drafts out, for one ModelRunner."""

    def __init__(
        self, config: SpeculativeConfig, runner: Any, rejection_sampler: RejectionSamplerFn
    ):
        self.config, self.runner = config, runner
        self.proposer = make_proposer(config, runner)
        self.verifier = DraftVerifier(rejection_sampler)
        self.max_batch_to_propose = (config.disable_by_batch_size or (1 << 62)) - 1

    def place_drafts(self, batch: "InputBatch", spec_token_ids: dict[str, list[int]]):
        """Write each request's drafts after its tokens in the batch (its ``num_tokens`` does
        not count them); returns ``[R]`` drafts per row."""
        num_drafts = np.zeros(batch.num_reqs, dtype=np.int64)
        for req_id, drafts in spec_token_ids.items():
            row = batch.req_id_to_index[req_id]
            start = int(batch.num_tokens[row])
            batch.token_ids[row, start : start + len(drafts)] = drafts
            num_drafts[row] = len(drafts)
        return num_drafts

    def draft_token_ids(
        self, batch: "InputBatch", rows: np.ndarray, num_drafts: np.ndarray, device
    ) -> torch.Tensor:
        """``[N]`` the drafts of ``rows``, flat in row order."""
        row, offset = ragged_index(num_drafts[rows])
        flat = batch.token_ids[rows[row], batch.num_tokens[rows[row]] + offset]
        return torch.from_numpy(flat.astype(np.int64)).to(device)

    def sample(
        self, logits: torch.Tensor, rows: np.ndarray, step: "StepInputs", failed: dict[str, str]
    ):
        """Sample a step that verifies drafts: ``(tokens [S, max_k + 1] -1 padded, logprobs per
        row)``; ``logits [sum(k + 1), V]`` are the target's at each row's draft and bonus
        positions. Rows without drafts sample as in any step (the platform's sampler: a
        request's random stream never depends on its neighbours' drafts); the others are
        verified."""
        num_drafts = step.num_drafts[rows]
        plain, drafted = np.flatnonzero(num_drafts == 0), np.flatnonzero(num_drafts > 0)
        if not len(plain):  # every row verifies drafts: every position is theirs
            return self._verify(logits, rows, num_drafts, step.draft_token_ids, failed)
        tokens = np.full((len(rows), int(num_drafts.max()) + 1), -1, dtype=np.int64)
        logprobs: list = [None] * len(rows)
        starts = np.cumsum(num_drafts + 1) - (num_drafts + 1)
        plain_logits = logits.index_select(0, torch.from_numpy(starts[plain]).to(logits.device))
        sampled, plain_logprobs = self.runner.sample_tokens(plain_logits, rows[plain], failed)
        tokens[plain, :1] = sampled
        for i, j in enumerate(plain.tolist()):
            logprobs[j] = plain_logprobs[i]
        positions = np.flatnonzero(np.repeat(num_drafts > 0, num_drafts + 1))
        drafted_logits = logits.index_select(0, torch.from_numpy(positions).to(logits.device))
        verified, verified_logprobs = self._verify(
            drafted_logits, rows[drafted], num_drafts[drafted], step.draft_token_ids, failed
        )
        tokens[drafted] = verified
        for i, j in enumerate(drafted.tolist()):
            logprobs[j] = verified_logprobs[i]
        return tokens, logprobs

    def _verify(
        self,
        logits: torch.Tensor,
        rows: np.ndarray,
        num_drafts: np.ndarray,
        draft_token_ids: torch.Tensor,
        failed: dict[str, str],
    ):
        """Rows with drafts: their accepted drafts and one more token each; the logits
        processors see each position with the drafts before it."""
        batch = self.runner.input_batch
        row, offset = positions_per_row(num_drafts)
        num_logprobs = batch.num_logprobs[rows]
        raw_logits = logits.clone() if (num_logprobs >= 0).any() else logits
        positions = batch.num_tokens[rows[row]] + offset
        logits = self.runner.process_logits(logits, rows[row], positions, failed)
        out = self.verifier(
            logits,
            batch.sampling_metadata(rows),
            num_drafts,
            draft_token_ids,
            self.proposer.draft_probs(batch, rows, num_drafts),
        )
        tokens = self._without_tokenless_rows(out, logits, rows, row).cpu().numpy()
        return tokens, emitted_logprobs(raw_logits, tokens, num_drafts, num_logprobs)

    def _without_tokenless_rows(self, out, logits, rows, position_row) -> torch.Tensor:
        """``out`` with -1 for each row that has a position where no token is left (the logits
        processors made every logit -inf there): such a row samples nothing, and fails. Only
        processed rows are looked at: the model's own logits are finite."""
        processed = self.runner.input_batch.adjusts_logits[rows]
        if not processed.any():
            return out
        positions = np.flatnonzero(processed[position_row])
        index = torch.from_numpy(positions).to(logits.device)
        no_token = torch.zeros(len(rows), dtype=torch.bool, device=logits.device)
        no_token.index_put_(
            (torch.from_numpy(position_row[positions]).to(logits.device),),
            ~torch.isfinite(logits.index_select(0, index)).any(dim=1),
            accumulate=True,
        )
        return out.masked_fill(no_token.unsqueeze(1), -1)

    def propose(self, context: ProposeContext, propose_all: bool = True) -> dict[str, list[int]]:
        """The next step's drafts for ``context.rows`` (those that sampled; only the seeded ones
        unless ``propose_all``), none when the batch holds ``disable_by_batch_size`` requests
        or more."""
        batch = context.batch
        if not propose_all:
            seeded = [row in batch.generators for row in context.rows.tolist()]
            context.rows = context.rows[np.array(seeded, dtype=bool)]
        rows = context.rows
        if len(rows) == 0 or batch.num_reqs > self.max_batch_to_propose:
            return {}
        drafts, num_drafts = self.proposer.propose(context)
        req_ids = batch.req_ids
        return {
            req_ids[rows[i]]: drafts[i, : num_drafts[i]].tolist()
            for i in np.flatnonzero(num_drafts).tolist()
        }
