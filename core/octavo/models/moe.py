"""Sparse Mixture-of-Experts members of the Llama family: Qwen3-MoE (Qwen3's attention, MoE
feed-forward blocks where ``decoder_sparse_step`` and ``mlp_only_layers`` put them) and Mixtral
(Mistral's attention, every block MoE). The experts run through ``Platform.fused_moe``."""

from __future__ import annotations

from typing import Optional

from octavo.errors import ConfigError
from octavo.models.layers.fused_moe import SparseMoeBlock, expert_stacked_params
from octavo.models.layers.linear import TPGroup
from octavo.models.llama import LlamaForCausalLM
from octavo.models.mistral import MistralForCausalLM
from octavo.models.qwen2 import qwen_sliding_window
from octavo.models.qwen3 import Qwen3Attention
from octavo.platform.types import MoESpec


def moe_spec(config, tp: TPGroup, num_experts: int, inner: int, renormalize: bool) -> MoESpec:
    """The MoE layers' spec: ``num_experts_per_tok`` of ``num_experts`` softmax-routed experts
    of inner width ``inner`` (this rank's share of it)."""
    hf = config.hf_config
    if config.hidden_act != "silu":
        raise ConfigError(f"hidden_act {config.hidden_act!r}: the MoE experts run silu only")
    return MoESpec(
        num_experts=num_experts,
        top_k=int(hf["num_experts_per_tok"]),
        hidden_size=config.hidden_size,
        intermediate_size=tp.split(inner, "moe_intermediate_size"),
        dtype=config.dtype,
        scoring="softmax",
        renormalize=renormalize,
    )


class _MoEMixin:
    """A Llama-family model whose feed-forward blocks are (some or all) sparse MoE blocks."""

    EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
    CHECKPOINT_BLOCK = ".mlp."

    def __init__(self, config, platform, **kwargs):
        self.STACKED_PARAMS = (  # the experts' names first: they contain ``.gate_proj.`` too
            *expert_stacked_params(
                self.num_experts(config), self.EXPERT_PROJECTIONS, self.CHECKPOINT_BLOCK
            ),
            *self.extra_stacked_params(),
            *LlamaForCausalLM.STACKED_PARAMS,
        )
        super().__init__(config, platform, **kwargs)

    @classmethod
    def extra_stacked_params(cls) -> tuple:
        return ()

    @classmethod
    def num_experts(cls, config) -> int:
        """``num_experts`` (Qwen's checkpoints) or ``num_local_experts`` (Mixtral's, and what
        transformers 5 writes for both)."""
        hf = config.hf_config
        return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)

    def is_sparse(self, config, layer_idx: int) -> bool:
        return True

    def spec(self, config, tp: TPGroup) -> MoESpec:
        raise NotImplementedError

    def make_mlp(self, config, platform, layer_idx: int, device, tp):
        if not self.is_sparse(config, layer_idx):
            return None
        return SparseMoeBlock(self.spec(config, tp), device=device, tp=tp)


class Qwen3MoeForCausalLM(_MoEMixin, LlamaForCausalLM):
    """Qwen3MoeForCausalLM: Qwen3's attention; MoE blocks of ``num_experts`` experts of
    ``moe_intermediate_size``, dense Llama MLPs of ``intermediate_size`` in the other layers."""

    attention_cls = Qwen3Attention

    def is_sparse(self, config, layer_idx: int) -> bool:
        hf = config.hf_config
        step = int(hf.get("decoder_sparse_step") or 1)
        only_mlp = hf.get("mlp_only_layers") or []
        return (
            layer_idx not in only_mlp
            and self.num_experts(config) > 0
            and ((layer_idx + 1) % step == 0)
        )

    def spec(self, config, tp: TPGroup) -> MoESpec:
        hf = config.hf_config
        inner = int(hf["moe_intermediate_size"])
        return moe_spec(config, tp, self.num_experts(config), inner, bool(hf["norm_topk_prob"]))

    @classmethod
    def sliding_window(cls, config, layer_idx: int) -> Optional[int]:
        return qwen_sliding_window(config.hf_config, layer_idx)


class MixtralForCausalLM(_MoEMixin, MistralForCausalLM):
    """MixtralForCausalLM: Mistral's attention; every block MoE (``num_local_experts`` experts of
    ``intermediate_size``, HF's ``block_sparse_moe`` with ``w1``/``w3``/``w2``), renormalised."""

    EXPERT_PROJECTIONS = ("w1", "w3", "w2")
    CHECKPOINT_BLOCK = ".block_sparse_moe."

    @classmethod
    def extra_stacked_params(cls) -> tuple:
        return ((".mlp.gate.", ".block_sparse_moe.gate.", None),)

    def spec(self, config, tp: TPGroup) -> MoESpec:
        return moe_spec(config, tp, self.num_experts(config), config.intermediate_size, True)
