"""P-EAGLE (parallel drafting): one head pass drafts all K tokens.

``{"method": "eagle", "model": HEAD, "num_speculative_tokens": K, "parallel_drafting": true}``,
as vLLM names it. The head is an EAGLE head (``octavo.spec_decode.eagle_head``) with two more
tensors, ``mask_embedding [hidden]`` and ``mask_hidden [hidden]``: the learned inputs of the
slots whose token and hidden state are not known yet. To draft, each row runs one chunk: its
verified positions of the step (each with the token after it and the target's hidden state, as
in serial EAGLE, the last one with the newest token), then K - 1 slots that read the mask
embedding and hidden state; the outputs from the last verified position on score the K drafts.
The KV written at the masked slots is rewritten by the head's pass once their tokens are
verified, as serial drafts' is; drafts never touch the output (verification is lossless).

With one layer a masked slot sees the slots before it only through their inputs, never what
the head predicts there; with two or more (P-EAGLE's own heads have several), a later layer's
slot attends to the earlier layers' outputs at the slots before it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from octavo.errors import ConfigError
from octavo.model_executor.step_inputs import ragged_index
from octavo.spec_decode.config import SpeculativeConfig
from octavo.spec_decode.drafting import drafter_config
from octavo.spec_decode.eagle import EagleProposer, VerifiedChunk
from octavo.spec_decode.eagle_head import EagleHead, check_eagle_head

MASK_TENSORS = ("mask_embedding", "mask_hidden")


class ParallelEagleHead(EagleHead):
    """An EAGLE head with the learned inputs of its masked slots."""

    def __init__(self, config, platform, *, block_size: int, device, **kwargs):
        super().__init__(config, platform, block_size=block_size, device=device, **kwargs)
        for name in MASK_TENSORS:
            empty = torch.zeros(config.hidden_size, dtype=config.dtype, device=device)
            setattr(self, name, nn.Parameter(empty, requires_grad=False))

    def forward(self, input_ids, hidden_states, positions, attn_metadata, masked=None):
        """As EAGLE's, with the tokens where ``masked [T]`` (bool) is set reading the mask
        embedding and hidden state instead of theirs: ``hidden_states`` then holds the other
        tokens' rows only, in order."""
        one_call = self.one_call()
        if one_call is not None:
            return one_call(input_ids, hidden_states, positions, attn_metadata, masked)
        if masked is None:
            embeds, hidden = self.inputs(input_ids, hidden_states)
            return self.predict(embeds, hidden, positions, attn_metadata)
        every = self.mask_hidden.expand(len(masked), -1).clone()
        every[~masked] = hidden_states.to(every.dtype)
        embeds, hidden = self.inputs(input_ids, every)
        embeds = torch.where(masked.unsqueeze(1), self.mask_embedding, embeds)
        return self.predict(embeds, hidden, positions, attn_metadata)


class ParallelEagleProposer(EagleProposer):
    """``method == "eagle"`` with ``parallel_drafting``: one head pass per verify step."""

    @staticmethod
    def load_head(config: SpeculativeConfig, runner: Any) -> tuple[Any, ParallelEagleHead]:
        model_config = drafter_config(config.model, runner)
        check_eagle_head(model_config, runner.model_config)
        missing = [n for n in MASK_TENSORS if n not in _tensor_names(model_config.model_path)]
        if missing:
            raise ConfigError(
                f"speculative_config.parallel_drafting needs a head trained for parallel "
                f"drafting; {config.model!r} has no {' or '.join(missing)}: drop "
                "parallel_drafting to draft serially with it"
            )
        return model_config, runner.load_model(model_config, ParallelEagleHead)

    def _draft(self, context, verified: VerifiedChunk, num_drafts, drafts, probs) -> None:
        """One head pass per row over its verified positions and K - 1 masked slots after them:
        the outputs from its last verified position on score its K drafts."""
        greedy = self._greedy_at_once(
            context, verified, num_drafts, drafts, probs, self.k, parallel=True
        )
        if greedy is not None:  # the platform's one call drafted them
            return
        batch, rows = context.batch, context.rows
        counts = verified.counts + np.maximum(num_drafts - 1, 0)
        row, offset = ragged_index(counts)
        masked = offset >= verified.counts[row]
        predicted = self._chunk_pass(  # the masked slots read no hidden state rows
            batch,
            rows,
            VerifiedChunk(verified.first, counts, verified.hidden),
            masked=torch.from_numpy(masked).to(self.device),
        )
        last = np.cumsum(counts) - counts + verified.counts - 1  # each row's last verified one
        draft_row, depth = ragged_index(num_drafts)
        wanted = torch.from_numpy(last[draft_row] + depth).to(self.device)
        at = verified.last[draft_row] + depth
        scored = predicted.index_select(0, wanted)  # one LM-head product scores them all
        self._sample_in_order(context, draft_row, depth, 0, at, scored, drafts, probs)


def _tensor_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as checkpoint:
            names.update(checkpoint.keys())
    return names
