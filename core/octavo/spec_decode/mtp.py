"""MTP: a checkpoint's own multi-token-prediction layer as the draft head.

A target whose ``config.json`` declares ``num_nextn_predict_layers`` >= 1 carries, after its
``num_hidden_layers`` decoder layers, that many MTP layers in DeepSeek-V3's format, under
``model.layers.{num_hidden_layers + i}.``: ``enorm`` and ``hnorm`` (RMSNorms of the next
token's embedding and of the hidden state), ``eh_proj [hidden, 2 * hidden]`` (their
concatenation, embedding first, down to one hidden state), one decoder layer (Llama names) and
``shared_head.norm``; ``embed_tokens`` and ``shared_head.head``, where stored, are the target's
own and are not loaded again.

At position p the layer reads the target's hidden state at p and the embedding of the token
at p + 1 and predicts the target's hidden state at p + 1: EAGLE's computation with the two
input norms, so the proposer is EAGLE's (``octavo.spec_decode.eagle``), run K serial steps on
the first MTP layer, as vLLM runs a one-layer MTP. The hidden state it reads is the target's
after its final norm (the runner's output); DeepSeek's MTP was trained on the one before it,
which costs acceptance there, never correctness (verification is lossless).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch

from octavo.errors import ConfigError
from octavo.models.layers.norm import RMSNorm
from octavo.spec_decode.config import SpeculativeConfig
from octavo.spec_decode.eagle import EagleProposer
from octavo.spec_decode.eagle_head import EagleHead

CONFIG_KEY = "num_nextn_predict_layers"
_RENAMES = (("eh_proj.", "fc."), ("shared_head.norm.", "norm."))
_LAYER_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")
_TARGETS_OWN = ("embed_tokens.", "shared_head.head.")


def num_mtp_layers(hf_config: dict[str, Any]) -> int:
    """How many MTP layers a target's HF config declares (0: none)."""
    return int(hf_config.get(CONFIG_KEY) or 0)


class MtpHead(EagleHead):
    """The first MTP layer of the target's checkpoint; built by the loader from the target's
    own ModelConfig (``model_cls``), then ``attach``-ed to the target."""

    def __init__(self, config, platform, *, block_size: int, device, **kwargs):
        # the target's config: one MTP layer, whatever the target's own depth
        super().__init__(
            config, platform, block_size=block_size, device=device, num_layers=1, **kwargs
        )
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps, platform, dtype=config.dtype, device=device)
        self.hnorm = RMSNorm(hidden, eps, platform, dtype=config.dtype, device=device)
        self.prefix = f"model.layers.{config.num_hidden_layers}."

    def inputs(self, input_ids, hidden_states) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, hidden = super().inputs(input_ids, hidden_states)
        return self.enorm(embeds), self.hnorm(hidden)

    def _head_name(self, name: str) -> str | None:
        """This module's name for a checkpoint tensor of the first MTP layer, else None."""
        if not name.startswith(self.prefix):
            return None
        name = name[len(self.prefix) :]
        if name.startswith(_TARGETS_OWN):
            return None
        for old, new in _RENAMES:
            if name.startswith(old):
                return new + name[len(old) :]
        return "layers.0." + name if name.startswith(_LAYER_PARTS) else name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = (
            (head_name, tensor)
            for head_name, tensor in ((self._head_name(n), t) for n, t in weights)
            if head_name is not None
        )
        return super().load_weights(renamed)


class MtpProposer(EagleProposer):
    """``speculative_config.method == "mtp"``: EAGLE's proposer on the target's MTP layer."""

    @staticmethod
    def load_head(config: SpeculativeConfig, runner: Any) -> tuple[Any, MtpHead]:
        target = runner.model_config
        if config.model is not None and not _same_folder(config.model, target.model_path):
            raise ConfigError(
                f"speculative_config.model {config.model!r} is not the target: the mtp method "
                "drafts with the target's own MTP layers; leave out the model (or name the "
                "target's folder)"
            )
        if num_mtp_layers(target.hf_config) < 1:
            raise ConfigError(
                f"the model in {str(target.model_path)!r} has no MTP layers (its config.json "
                f"declares no {CONFIG_KEY}); use another speculative method (ngram, eagle)"
            )
        return target, runner.load_model(target, MtpHead)


def _same_folder(a: Any, b: Any) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
