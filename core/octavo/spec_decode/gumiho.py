"""Gumiho (arXiv 2503.10135): the first drafts by a serial head, the rest at once by parallel
MLP heads.

``{"method": "gumiho", "model": HEAD, "num_speculative_tokens": K}``. The early drafts decide
how many of the later ones can count, so they get the stronger model: the head folder holds an
EAGLE head (``octavo.spec_decode.eagle_head``: ``fc``, its decoder layers, ``norm``) that drafts
the first ``num_serial_drafts`` tokens (2) serially, as EAGLE does, its KV on the target's block
ids, and ``num_parallel_heads`` MLP heads that draft the rest at once, from the same inputs and
independent of one another (one LM-head product scores them all). MLP head i
reads ``[embedding of the last serial draft, the serial head's last predicted hidden state]``
(``fc`` from 2 x hidden to hidden, a SwiGLU MLP of ``parallel_intermediate_size`` with a
residual, ``norm``) and predicts the hidden state i + 1 positions after that draft, which the
target's LM head scores. The MLP heads keep no KV; K is at most ``num_serial_drafts +
num_parallel_heads``.

``config.json``: the EAGLE head's (the target's layer shape, its number of layers) with
``"architectures": ["GumihoHead"]``, ``num_serial_drafts``, ``num_parallel_heads``,
``parallel_intermediate_size``; ``model.safetensors``: the EAGLE head's tensors and
``parallel_heads.{i}.fc.weight``, ``.mlp_norm.weight``, ``.mlp.{gate,up,down}_proj.weight``,
``.norm.weight``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from octavo.errors import ConfigError
from octavo.model_executor.step_inputs import ragged_index
from octavo.models.layers.linear import ColumnParallelLinear, TPGroup
from octavo.models.layers.norm import RMSNorm
from octavo.models.llama import LlamaMLP
from octavo.spec_decode.config import SpeculativeConfig
from octavo.spec_decode.drafting import drafter_config
from octavo.spec_decode.eagle import EagleProposer
from octavo.spec_decode.eagle_head import EagleHead, check_eagle_head, head_config

ARCHITECTURE = "GumihoHead"
NUM_SERIAL_DRAFTS = 2


class ParallelDraftHead(nn.Module):
    """One MLP head: ``x = fc([embedding, hidden])``, then ``norm(x + mlp(mlp_norm(x)))`` (a
    SwiGLU MLP), under its checkpoint names. Its linears are packed by the platform like the
    decoder layers', so a head is a handful of the platform's kernels."""

    def __init__(self, config, platform, *, intermediate_size: int, device):
        super().__init__()
        hidden, eps, dtype = config.hidden_size, config.rms_norm_eps, config.dtype
        self.fc = ColumnParallelLinear(
            2 * hidden, (hidden,), bias=False, dtype=dtype, device=device
        )
        self.mlp_norm = RMSNorm(hidden, eps, platform, dtype=dtype, device=device)
        mlp_config = dataclasses.replace(config, intermediate_size=intermediate_size)
        self.mlp = LlamaMLP(mlp_config, platform, device=device, tp=TPGroup())
        self.norm = RMSNorm(hidden, eps, platform, dtype=dtype, device=device)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.fc(inputs)
        out, _ = self.norm(self.mlp(self.mlp_norm(x)), x)
        return out


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

    def draft_in_parallel(self, last_drafts, hidden_states, count: int) -> torch.Tensor:
        """``[count, R, H]``: the first ``count`` MLP heads' predictions from the last serial
        drafts ``last_drafts [R]`` and the serial head's hidden states after them, head by head
        (each reads the same ``[embedding, hidden]``)."""
        one_call = self.one_call("draft_in_parallel")
        if one_call is not None:
            return one_call(last_drafts, hidden_states, count)
        inputs = torch.cat(self.inputs(last_drafts, hidden_states), dim=-1)
        return torch.stack([head(inputs) for head in self.parallel_heads[:count]])


class GumihoProposer(EagleProposer):
    """``speculative_config.method == "gumiho"``."""

    @staticmethod
    def load_head(config: SpeculativeConfig, runner: Any) -> tuple[Any, GumihoHead]:
        model_config = drafter_config(config.model, runner)
        check_gumiho_head(model_config, runner.model_config, config.num_speculative_tokens)
        return model_config, runner.load_model(model_config, GumihoHead)

    def _draft(self, context, verified, num_drafts, drafts, probs) -> None:
        """The serial head's drafts, then the rest from the MLP heads at once (sampled in
        order, so each one's logits processors see the drafts before it); a greedy step where
        every row drafts K in the head's one call, where the platform has one."""
        serial = min(self.k, self.model.num_serial_drafts)
        positions = verified.last
        one_call_mlp = self.model.one_call("draft_in_parallel") is not None
        mlp_drafts = self.k - serial if one_call_mlp else 0
        at_once = self._greedy_at_once(
            context, verified, num_drafts, drafts, probs, serial, mlp_drafts=mlp_drafts
        )
        if at_once is None:
            predicted = self._verified_pass(context, verified)
            active, hidden = self._draft_serially(
                context, positions, predicted, num_drafts, drafts, probs, serial
            )
        elif mlp_drafts:
            return
        else:
            active, hidden = at_once
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
        scored = predicted.flatten(0, 1).index_select(0, wanted)  # one LM-head product
        at = positions[active[row]] + serial + depth
        self._sample_in_order(context, active[row], depth, serial, at, scored, drafts, probs)


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
    target_config: dict[str, Any],
    num_parallel_heads: int,
    parallel_intermediate_size: int,
    layers: int = 1,
) -> dict[str, Any]:
    """The ``config.json`` of a Gumiho head (its serial head of ``layers`` decoder layers) for a
    target of HF config ``target_config``."""
    config = head_config(target_config, layers)
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
