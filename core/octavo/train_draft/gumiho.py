"""Training a Gumiho head (``octavo.spec_decode.gumiho``): EAGLE's serial head for the first
two drafts, MLP heads for the rest, on the target's own outputs.

The serial head trains as an EAGLE head with two rollouts (the second reads its own first
prediction, as its second draft does). At each position t its second rollout's prediction is
the hidden state the head reaches after its second draft of a pass anchored at t - 1; MLP head
i reads it with the embedding of that draft (the token at t + 2, as when the drafts are right,
the only case in which later drafts count) and learns the target's hidden state at t + 2 + i:
forward KL from the target's next-token distribution to the head's, plus a smooth-L1
regression, weighted ``decay ** (2 + i)``. The MLP heads read the serial head's predictions
without sending gradients back into it: the serial head learns exactly as an EAGLE head."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from octavo.spec_decode.gumiho import NUM_SERIAL_DRAFTS, gumiho_head_config
from octavo.train_draft.eagle import (
    EagleTraining,
    TrainableEagleHead,
    rollout_loss,
    target_features,
)


@dataclasses.dataclass(frozen=True)
class GumihoTraining:
    """The method's settings."""

    num_parallel_heads: int = 4  # drafts 3 .. 2 + this
    parallel_intermediate_size: int = 256  # each MLP head's SwiGLU width
    decay: float = 0.8  # weight of draft d (0-based): decay ** d
    regression_weight: float = 0.1  # smooth-L1 of the hidden state, beside the KL


class TrainableParallelDraftHead(nn.Module):
    """One MLP head in transformers' Llama modules (the names the engine loads)."""

    def __init__(self, head_config, intermediate_size: int):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        hidden = head_config.hidden_size
        mlp_config = copy.copy(head_config)
        mlp_config.intermediate_size = intermediate_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.mlp_norm = LlamaRMSNorm(hidden, eps=head_config.rms_norm_eps)
        self.mlp = LlamaMLP(mlp_config)
        self.norm = LlamaRMSNorm(hidden, eps=head_config.rms_norm_eps)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.fc(inputs)
        return self.norm(hidden + self.mlp(self.mlp_norm(hidden)))


class TrainableGumihoHead(TrainableEagleHead):
    """The serial EAGLE head and ``num_parallel_heads`` MLP heads."""

    def __init__(self, head_config, target: nn.Module):
        super().__init__(head_config, target)
        self.parallel_heads = nn.ModuleList(
            TrainableParallelDraftHead(head_config, head_config.parallel_intermediate_size)
            for _ in range(head_config.num_parallel_heads)
        )

    @staticmethod
    def checkpoint_config(target_config: dict, method: GumihoTraining, layers: int = 1) -> dict:
        return gumiho_head_config(
            target_config, method.num_parallel_heads, method.parallel_intermediate_size, layers
        )

    def draft_in_parallel(self, last_ids: torch.Tensor, hidden: torch.Tensor) -> list:
        """Each MLP head's ``[B, T, H]`` predictions from the last serial drafts ``last_ids
        [B, T]`` and the serial head's hidden states after them."""
        inputs = torch.cat([self.target.model.embed_tokens(last_ids), hidden], dim=-1)
        return [head(inputs) for head in self.parallel_heads]


def gumiho_loss_of(head: TrainableGumihoHead, windows: torch.Tensor, method: GumihoTraining):
    """``(loss, per-draft top-1 agreement)`` on a batch of windows ``[B, L]``."""
    hidden = target_features(head.target, windows)
    serial = EagleTraining(
        rollouts=NUM_SERIAL_DRAFTS,
        rollout_decay=method.decay,
        regression_weight=method.regression_weight,
    )
    total, agreement, reached = rollout_loss(head, windows, hidden, serial)
    length = windows.shape[1]  # positions t = 0 .. length - 2 have a prediction in `reached`
    usable = length - 2  # anchors t whose last serial draft, the token t + 2, is in the window
    last_ids = windows[:, 2 : 2 + usable]
    predicted = head.draft_in_parallel(last_ids, reached[:, :usable].detach())
    for i, guess in enumerate(predicted):
        valid = usable - i  # anchors whose target hidden[t + 2 + i] is in the window
        wanted = hidden[:, 2 + i : 2 + i + valid]
        with torch.no_grad():
            wanted_logprobs = F.log_softmax(head.target.lm_head(wanted).float(), dim=-1)
        guess = guess[:, :valid]
        logprobs = F.log_softmax(head.target.lm_head(guess).float(), dim=-1)
        kl = F.kl_div(logprobs, wanted_logprobs, log_target=True, reduction="none").sum(-1)
        regression = F.smooth_l1_loss(guess, wanted, reduction="none").mean(-1)
        weight = method.decay ** (NUM_SERIAL_DRAFTS + i)
        total = total + weight * (kl.mean() + method.regression_weight * regression.mean())
        hits = logprobs.argmax(-1) == wanted_logprobs.argmax(-1)
        agreement.append(hits.float().mean().item())
    return total, agreement
