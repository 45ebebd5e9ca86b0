"""Gumiho (arXiv 2503.10135): the first drafts by a serial head, the rest at once by parallel
MLP heads.

``{"method": "gumiho", "model": HEAD, "num_speculative_tokens": K}``. The early drafts decide
how many of the later ones can count, so they get the stronger model: the head folder holds an
EAGLE head (``octavo.spec_decode.eagle_head``: ``fc``, one decoder layer, ``norm``) that drafts
the first ``num_serial_drafts`` tokens (2) serially, as EAGLE does, its KV on the target's block
ids, and ``num_parallel_heads`` MLP heads that draft the rest in one batched pass. MLP head i
reads ``[embedding of the last serial draft, the serial head's last predicted hidden state]``
(``fc`` from 2 x hidden to hidden, a SwiGLU MLP of ``parallel_intermediate_size`` with a
residual, ``norm``) and predicts the hidden state i + 1 positions after that draft, which the
target's LM head scores. The MLP heads keep no KV; K is at most ``num_serial_drafts +
num_parallel_heads``.

``config.json``: the EAGLE head's (the target's layer shape, one layer) with ``"architectures":
["GumihoHead"]``, ``num_serial_drafts``, ``num_parallel_heads``, ``parallel_intermediate_size``;
``model.safetensors``: the EAGLE head's tensors and ``parallel_heads.{i}.fc.weight``,
``.mlp_norm.weight``, ``.mlp.{gate,up,down}_proj.weight``, ``.norm.weight``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from octavo.errors import ConfigError
from octavo.model_executor.step_inputs import ragged_index
from octavo.models.layers.linear import TPGroup
from octavo.models.layers.norm import RMSNorm
from octavo.models.llama import LlamaMLP
from octavo.spec_decode.config import SpeculativeConfig
from octavo.spec_decode.drafting import drafter_config
from octavo.spec_decode.eagle import EagleProposer
from octavo.spec_decode.eagle_head import EagleHead, check_eagle_head, head_config

ARCHITECTURE = "GumihoHead"
NUM_SERIAL_DRAFTS = 2


class ParallelDraftHead(nn.Module):
    """One MLP head's weights, under their checkpoint names (``GumihoHead`` runs them all at
    once)."""

    def __init__(self, config, platform, *, intermediate_size: int, device):
        super().__init__()
        hidden, eps, dtype = config.hidden_size, config.rms_norm_eps, config.dtype
        self.fc = nn.Linear(2 * hidden, hidden, bias=False, dtype=dtype, device=device)
        self.mlp_norm = RMSNorm(hidden, eps, platform, dtype=dtype, device=device)
        mlp_config = dataclasses.replace(config, intermediate_size=intermediate_size)
        self.mlp = LlamaMLP(mlp_config, platform, device=device, tp=TPGroup())
        self.norm = RMSNorm(hidden, eps, platform, dtype=dtype, device=device)


@dataclasses.dataclass(frozen=True)
class StackedHeads:
    """The MLP heads' weights stacked along a first, head axis (copies made at load)."""

    fc: torch.Tensor  # [M, H, 2H]
    mlp_norm: torch.Tensor  # [M, 1, H]
    gate: torch.Tensor  # [M, I, H]
    up: torch.Tensor  # [M, I, H]
    down: torch.Tensor  # [M, H, I]
    norm: torch.Tensor  # [M, 1, H]

    @classmethod
    def of(cls, heads) -> "StackedHeads":
        def stack(weights):
            return torch.stack([w.detach() for w in weights]).contiguous()

        inner = heads[0].mlp.down_proj.weight.shape[1]
        gate_up = [h.mlp.gate_up_proj.weight for h in heads]
        return cls(
            fc=stack(h.fc.weight for h in heads),
            mlp_norm=stack(h.mlp_norm.weight for h in heads).unsqueeze(1),
            gate=stack(w[:inner] for w in gate_up),
            up=stack(w[inner:] for w in gate_up),
            down=stack(h.mlp.down_proj.weight for h in heads),
            norm=stack(h.norm.weight for h in heads).unsqueeze(1),
        )


class GumihoHead(EagleHead):
    """The serial EAGLE head and the parallel MLP heads."""

    def __init__(self, config, platform, *, block_size: int, device, **kwargs):
        super().__init__(config, platform, block_size=block_size, device=device, **kwargs)
        fields = config.hf_config
        self.num_serial_drafts = int(fields["num_serial_drafts"])
        self.parallel_heads = nn.ModuleList(
            ParallelDraftHead(
                config,
                platform,
                intermediate_size=int(fields["parallel_intermediate_size"]),
                device=device,
            )
            for _ in range(int(fields["num_parallel_heads"]))
        )
        hidden = config.hidden_size
        self._rms_norm = platform.rms_norm(hidden, config.rms_norm_eps, config.dtype)
        self._silu_and_mul = platform.silu_and_mul()
        self._unit = torch.ones(hidden, dtype=config.dtype, device=device)
        self._stacked: Optional[StackedHeads] = None

    def load_weights(self, weights) -> set[str]:
        loaded = super().load_weights(weights)
        self._stacked = StackedHeads.of(self.parallel_heads)
        return loaded

    def draft_in_parallel(self, last_drafts, hidden_states, count: int) -> torch.Tensor:
        """``[count, R, H]``: the first ``count`` MLP heads' predictions from the last serial
        drafts ``last_drafts [R]`` and the serial head's hidden states after them. Head i:
        ``x = fc_i([embedding, hidden])``, then ``norm_i(x + down_i(silu(gate_i(n)) *
        up_i(n)))`` with ``n = mlp_norm_i(x)``; every head in one batched matmul per step."""
        w = self._stacked
        embeds, hidden = self.inputs(last_drafts, hidden_states)
        inputs = torch.cat([embeds, hidden], dim=-1)
        x = torch.matmul(inputs, w.fc[:count].transpose(1, 2))  # [count, R, H]
        shape = x.shape
        normed = self._rms_norm(x.flatten(0, 1), self._unit).view(shape) * w.mlp_norm[:count]
        gate = torch.matmul(normed, w.gate[:count].transpose(1, 2)).flatten(0, 1)
        up = torch.matmul(normed, w.up[:count].transpose(1, 2)).flatten(0, 1)
        inner = self._silu_and_mul(gate, up).view(count, shape[1], -1)
        down = torch.matmul(inner, w.down[:count].transpose(1, 2))
        out, _ = self._rms_norm(down.flatten(0, 1), self._unit, x.flatten(0, 1))
        return out.view(shape) * w.norm[:count]


class GumihoProposer(EagleProposer):
    """``speculative_config.method == "gumiho"``."""

    @staticmethod
    def load_head(config: SpeculativeConfig, runner: Any) -> tuple[Any, GumihoHead]:
        model_config = drafter_config(config.model, runner)
        check_gumiho_head(model_config, runner.model_config, config.num_speculative_tokens)
        return model_config, runner.load_model(model_config, GumihoHead)

    def _draft(self, context, verified, num_drafts, drafts, probs) -> None:
        """The serial head's drafts, then the rest from the MLP heads in one pass (sampled in
        order, so each one's logits processors see the drafts before it)."""
        serial = min(self.k, self.model.num_serial_drafts)
        positions = verified.last
        predicted = self._verified_pass(context, verified)
        active, hidden = self._draft_serially(
            context, positions, predicted, num_drafts, drafts, probs, serial
        )
        more = num_drafts[active] - serial
        keep = more > 0
        if not keep.any():
            return
        if not keep.all():
            active, more = active[keep], more[keep]
            hidden = hidden[torch.from_numpy(keep).to(self.device)]
        last = torch.from_numpy(drafts[active, serial - 1]).to(self.device)
        predicted = self.model.draft_in_parallel(last, hidden, int(more.max()))  # [J, R', H]
        row, depth = ragged_index(more)  # the drafts each row still wants
        wanted = torch.from_numpy(depth * len(active) + row).to(self.device)
        logits = self.model.compute_logits(predicted.flatten(0, 1).index_select(0, wanted))
        at = positions[active[row]] + serial + depth
        self._sample_in_order(context, active[row], depth, serial, at, logits, drafts, probs)


def check_gumiho_head(head, target, num_speculative_tokens: int) -> None:
    """A Gumiho head must be one for this target, drafting at least K tokens."""
    check_eagle_head(head, target, ARCHITECTURE, "octavo.spec_decode.gumiho")
    fields = head.hf_config
    missing = [
        name
        for name in ("num_serial_drafts", "num_parallel_heads", "parallel_intermediate_size")
        if name not in fields
    ]
    if missing:
        raise ConfigError(
            f"speculative_config.model is not a Gumiho head: its config.json lacks "
            f"{', '.join(missing)} (the format: octavo.spec_decode.gumiho)"
        )
    most = int(fields["num_serial_drafts"]) + int(fields["num_parallel_heads"])
    if num_speculative_tokens > most:
        raise ConfigError(
            f"speculative_config.num_speculative_tokens is {num_speculative_tokens}, but this "
            f"Gumiho head drafts at most {most} tokens ({fields['num_serial_drafts']} serial, "
            f"{fields['num_parallel_heads']} parallel); ask for {most} or fewer"
        )


def gumiho_head_config(
    target_config: dict[str, Any], num_parallel_heads: int, parallel_intermediate_size: int
) -> dict[str, Any]:
    """The ``config.json`` of a Gumiho head for a target of HF config ``target_config``."""
    config = head_config(target_config)
    config.update(
        architectures=[ARCHITECTURE],
        num_serial_drafts=NUM_SERIAL_DRAFTS,
        num_parallel_heads=num_parallel_heads,
        parallel_intermediate_size=parallel_intermediate_size,
    )
    return config


def parallel_head_tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of the MLP heads' tensors of a head of ``config``."""
    hidden, inner = config["hidden_size"], config["parallel_intermediate_size"]
    shapes = {}
    for i in range(config["num_parallel_heads"]):
        prefix = f"parallel_heads.{i}."
        shapes.update(
            {
                f"{prefix}fc.weight": (hidden, 2 * hidden),
                f"{prefix}mlp_norm.weight": (hidden,),
                f"{prefix}mlp.gate_proj.weight": (inner, hidden),
                f"{prefix}mlp.up_proj.weight": (inner, hidden),
                f"{prefix}mlp.down_proj.weight": (hidden, inner),
                f"{prefix}norm.weight": (hidden,),
            }
        )
    return shapes
