"""P-EAGLE (parallel drafting): one head pass drafts all K tokens.

``{"method": "eagle", "model": HEAD, "num_speculative_tokens": K, "parallel_drafting": true}``,
as vLLM names it. The head is an EAGLE head (``octavo.spec_decode.eagle_head``) with two more
tensors, ``mask_embedding [hidden]`` and ``mask_hidden [hidden]``: the learned inputs of the
slots whose token and hidden state are not known yet. To draft, each row runs one chunk of K
positions from its last verified one: that position reads the newest token and the target's
hidden state, as in serial EAGLE; the K - 1 after it read the mask embedding and hidden state,
and each of the K outputs scores one draft. The KV written at the masked positions is rewritten
by the head's pass over the next step's verified tokens (``forward_step``), as serial drafts'
is; drafts never touch the output (verification is lossless).
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
from octavo.spec_decode.drafting import chunk_metadata, drafter_config
from octavo.spec_decode.eagle import EagleProposer
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
        embedding and hidden state instead of theirs."""
        embeds, hidden = self.inputs(input_ids, hidden_states)
        if masked is not None:
            where = masked.unsqueeze(1)
            embeds = torch.where(where, self.mask_embedding, embeds)
            hidden = torch.where(where, self.mask_hidden, hidden)
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

    def _draft(self, context, positions, hidden, num_drafts, drafts, probs) -> None:
        batch, rows = context.batch, context.rows
        active = np.flatnonzero(num_drafts > 0)
        if len(active) == 0:
            return
        counts, first = num_drafts[active].astype(np.int64), positions[active]
        row, offset = ragged_index(counts)
        at = first[row] + offset
        known = offset == 0  # the last verified position: the newest token is after it
        tokens = np.where(known, batch.token_ids[rows[active][row], first[row] + 1], 0)
        inputs = hidden.new_zeros(len(at), hidden.shape[-1])
        inputs[torch.from_numpy(np.flatnonzero(known)).to(self.device)] = hidden[
            torch.from_numpy(active).to(self.device)
        ]
        attn = chunk_metadata(batch, rows[active], first, counts, self.block_size, self.device)
        predicted = self.model(
            torch.from_numpy(tokens.astype(np.int64)).to(self.device),
            inputs,
            torch.from_numpy(at).to(self.device),
            attn,
            masked=torch.from_numpy(~known).to(self.device),
        )
        logits = self.model.compute_logits(predicted)  # one LM-head matmul for every draft
        for j in range(int(counts.max())):  # drafts in order: each one's processors see the
            here = offset == j  # drafts before it, as serially
            index = torch.from_numpy(np.flatnonzero(here)).to(self.device)
            self._sample_logits(
                context, active[counts > j], j, at[here], logits[index], drafts, probs
            )


def _tensor_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as checkpoint:
            names.update(checkpoint.keys())
    return names
