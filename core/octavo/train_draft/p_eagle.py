"""Training a P-EAGLE head (``octavo.spec_decode.p_eagle``): an EAGLE head that drafts K tokens
in one pass, the slots after the first reading a learned mask embedding and hidden state.

Every position t of a window is an anchor, as in the engine: the head reads the target's hidden
state at t and the token at t + 1 there, and at t + 1 .. t + K - 1 the mask inputs; the output
at t + j learns the target's hidden state at t + 1 + j (forward KL from the target's next-token
distribution to the head's, plus a smooth-L1 regression, weighted ``decay ** j``). All anchors
train at once: the window's real positions and, per depth j, one masked slot per anchor, under
an attention mask that lets the slot of anchor t at depth j see the real positions up to t and
that anchor's slots of depth 1 .. j, which is what the head's KV holds when it drafts."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from octavo.train_draft.eagle import TrainableEagleHead, target_features


@dataclasses.dataclass(frozen=True)
class ParallelTraining:
    """The method's settings."""

    depth: int = 4  # drafts per pass (K)
    depth_decay: float = 0.8  # weight of depth j: decay ** j
    regression_weight: float = 0.1  # smooth-L1 of the hidden state, beside the KL


class TrainableParallelHead(TrainableEagleHead):
    """The EAGLE head with the mask inputs (``mask_embedding``, ``mask_hidden``: the names the
    engine loads)."""

    def __init__(self, head_config, target: nn.Module):
        super().__init__(head_config, target)
        hidden = head_config.hidden_size
        self.mask_embedding = nn.Parameter(torch.randn(hidden) * 0.02)
        self.mask_hidden = nn.Parameter(torch.randn(hidden) * 0.02)

    def forward_parallel(self, next_ids, hidden, depth: int) -> torch.Tensor:
        """``[B, depth, T, H]``: at ``[:, j, t]`` the predicted hidden state after position
        ``t + j`` of a pass anchored at ``t`` (``j = 0``: the real position)."""
        batch, length, size = hidden.shape
        real = self.fc(torch.cat([self.target.model.embed_tokens(next_ids), hidden], dim=-1))
        masked = self.fc(torch.cat([self.mask_embedding, self.mask_hidden]))
        x = torch.cat([real, masked.expand(batch, (depth - 1) * length, size)], dim=1)
        anchor = torch.arange(length, device=x.device).repeat(depth)
        level = torch.arange(depth, device=x.device).repeat_interleave(length)
        positions = (anchor + level).unsqueeze(0)
        visible = parallel_attention_mask(anchor, level)
        bias = torch.zeros(visible.shape, dtype=x.dtype).masked_fill(~visible, float("-inf"))
        cos_sin = self.rotary_emb(x, positions)
        out = self.run_layers(x, positions, cos_sin, attention_mask=bias[None, None])
        return self.norm(out).view(batch, depth, length, size)


def parallel_attention_mask(anchor: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
    """``[Q, Q]`` bool: query ``(anchor t, level j)`` sees the real positions ``<= t`` and the
    slots of its own anchor at levels ``1 .. j``."""
    real_key = level[None, :] == 0
    sees_real = real_key & (anchor[None, :] <= anchor[:, None])
    own_slot = (
        (~real_key) & (anchor[None, :] == anchor[:, None]) & (level[None, :] <= level[:, None])
    )
    return sees_real | own_slot


def parallel_loss_of(head: TrainableParallelHead, windows: torch.Tensor, method: ParallelTraining):
    """``(loss, per-depth top-1 agreement)`` on a batch of windows."""
    hidden = target_features(head.target, windows)
    length = windows.shape[1] - 1
    inputs, next_ids = hidden[:, :-1], windows[:, 1:]
    predicted = head.forward_parallel(next_ids, inputs, method.depth)
    total, agreement = 0.0, []
    for j in range(method.depth):
        valid = length - j  # anchors t whose target t + 1 + j is in the window
        wanted = hidden[:, 1 + j : 1 + j + valid]
        with torch.no_grad():
            wanted_logprobs = F.log_softmax(head.target.lm_head(wanted).float(), dim=-1)
        guess = predicted[:, j, :valid]
        logprobs = F.log_softmax(head.target.lm_head(guess).float(), dim=-1)
        kl = F.kl_div(logprobs, wanted_logprobs, log_target=True, reduction="none").sum(-1)
        regression = F.smooth_l1_loss(guess, wanted, reduction="none").mean(-1)
        weight = method.depth_decay**j
        total = total + weight * (kl.mean() + method.regression_weight * regression.mean())
        hits = logprobs.argmax(-1) == wanted_logprobs.argmax(-1)
        agreement.append(hits.float().mean().item())
    return total, agreement
