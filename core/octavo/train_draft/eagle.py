"""Training an EAGLE head (``octavo.spec_decode.eagle_head``) on its target's own outputs.

At each position p of a window the head gets the target's hidden state at p (after its final
norm) and the token at p + 1, and learns the target's hidden state at p + 1: forward KL from the
target's next-token distribution to the head's (both through the target's LM head) plus a
smooth-L1 regression of the hidden state. Serial drafting feeds the head its own predictions
from the second draft on, so training rolls out too: rollout r feeds each position the head's
prediction of rollout r - 1 in place of the target's hidden state, and adds its loss."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class EagleTraining:
    """The method's settings."""

    rollouts: int = 3  # serial draft steps simulated per position
    rollout_decay: float = 0.8  # weight of rollout r: decay ** r
    regression_weight: float = 0.1  # smooth-L1 of the hidden state, beside the KL


class TrainableEagleHead(nn.Module):
    """The head with transformers' Llama layer (the same weights and names the engine loads),
    on a frozen target's embedding and LM head."""

    def __init__(self, head_config, target: nn.Module):
        super().__init__()
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        head_config._attn_implementation = "sdpa"  # causal attention without a mask
        hidden = head_config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(head_config, i) for i in range(head_config.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(hidden, eps=head_config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(head_config)
        self._target = (target,)  # not a submodule: frozen, not saved

    @staticmethod
    def checkpoint_config(target_config: dict, method, layers: int = 1) -> dict:
        """The ``config.json`` of a head of ``layers`` decoder layers for a target of HF config
        ``target_config``."""
        from octavo.spec_decode.eagle_head import head_config

        return head_config(target_config, layers)

    @property
    def target(self) -> nn.Module:
        return self._target[0]

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, T, H]`` predicted hidden states after each position, from the tokens after
        them ``next_ids [B, T]`` and the hidden states there ``hidden [B, T, H]``."""
        embeds = self.target.model.embed_tokens(next_ids)
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        cos_sin = self.rotary_emb(x, positions)
        return self.norm(self.run_layers(x, positions, cos_sin))

    def run_layers(self, x, positions, cos_sin, attention_mask=None) -> torch.Tensor:
        """The decoder layers over ``x [B, T, H]`` (causal, or under ``attention_mask``)."""
        for layer in self.layers:
            out = layer(
                x,
                attention_mask=attention_mask,
                position_embeddings=cos_sin,
                position_ids=positions,
            )
            x = out[0] if isinstance(out, tuple) else out
        return x

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors of the head's checkpoint (the rotary buffers are recomputed)."""
        return {
            k: v.detach().contiguous() for k, v in self.state_dict().items() if "rotary" not in k
        }


@torch.no_grad()
def target_features(target: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """The target's final hidden states (after its norm) over ``windows [B, T]``."""
    return target.model(input_ids=windows).last_hidden_state


def loss_of(head: TrainableEagleHead, windows: torch.Tensor, method: EagleTraining):
    """``(loss, per-rollout top-1 agreement)`` on a batch of windows."""
    hidden = target_features(head.target, windows)
    total, agreement, _ = rollout_loss(head, windows, hidden, method)
    return total, agreement


def rollout_loss(head: TrainableEagleHead, windows, hidden, method: EagleTraining):
    """``(loss, per-rollout top-1 agreement, the last rollout's predictions [B, T - 1, H])``
    of the serial rollouts over ``windows [B, T]`` with the target's ``hidden`` states there."""
    inputs, next_ids, wanted = hidden[:, :-1], windows[:, 1:], hidden[:, 1:]
    with torch.no_grad():
        wanted_logprobs = F.log_softmax(head.target.lm_head(wanted).float(), dim=-1)
        wanted_tokens = wanted_logprobs.argmax(dim=-1)
    total, agreement = 0.0, []
    features = inputs
    for rollout in range(method.rollouts):
        predicted = head(next_ids, features)
        logprobs = F.log_softmax(head.target.lm_head(predicted).float(), dim=-1)
        kl = F.kl_div(logprobs, wanted_logprobs, log_target=True, reduction="none").sum(-1)
        regression = F.smooth_l1_loss(predicted, wanted, reduction="none").mean(-1)
        weight = method.rollout_decay**rollout
        total = total + weight * (kl.mean() + method.regression_weight * regression.mean())
        agreement.append((logprobs.argmax(-1) == wanted_tokens).float().mean().item())
        # the next rollout reads this one's prediction for each position (shifted by one)
        features = torch.cat([inputs[:, :1], predicted[:, :-1]], dim=1)
    return total, agreement, predicted
