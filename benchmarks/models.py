"""Random-weight Llama checkpoints of the sizes the peer figures use (../shared/PEERS.md).

python benchmarks/models.py small /tmp/small-llama      # ~100M parameters, bf16 weights
python benchmarks/models.py tiny /tmp/tiny-llama        # ~5M parameters, fp32 weights
python benchmarks/models.py moe /tmp/tiny-moe          # Qwen3-MoE, 16 experts (4 per token), fp32
python benchmarks/models.py mla /tmp/tiny-mla          # DeepSeek-V3 latent attention, dense, bf16

``real`` is no random model: SmolLM2-135M-Instruct's bfloat16 folder, which
``benchmarks/real_model.py`` fetches and writes (once) to REAL_MODEL.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
import octavo  # noqa: F401
import torch

from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model

MODEL_SPECS = {
    "tiny": TinyModelSpec(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=768,
        vocab_size=8192,
        max_position_embeddings=2048,
    ),
    "small": TinyModelSpec(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=32000,
        max_position_embeddings=2048,
    ),
    # Qwen3-MoE at the tiny model's width: 16 experts of 256, 4 per token (a quarter of the
    # expert weights read per token), every layer MoE
    "moe": TinyModelSpec(
        architecture="Qwen3MoeForCausalLM",
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=768,
        vocab_size=8192,
        max_position_embeddings=2048,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        extra_config=(("norm_topk_prob", True),),
    ),
    # DeepSeek-V3's latent attention at its per-head widths (latent 512, rotary 64, nope 128,
    # value 128) with 16 heads, every layer dense: decode cost is the attention's
    "mla": TinyModelSpec(
        architecture="DeepseekV3ForCausalLM",
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=1536,
        vocab_size=8192,
        max_position_embeddings=4096,
        num_experts=8,
        moe_intermediate_size=256,
        extra_config=(
            ("kv_lora_rank", 512),
            ("q_lora_rank", 384),
            ("qk_rope_head_dim", 64),
            ("qk_nope_head_dim", 128),
            ("v_head_dim", 128),
            ("rope_interleave", True),
            ("first_k_dense_replace", 4),
        ),
    ),
}
MODEL_DTYPES = {
    "tiny": torch.float32,
    "small": torch.bfloat16,
    "moe": torch.float32,
    "mla": torch.bfloat16,
    "real": torch.bfloat16,
}
SIZES = ("tiny", "small", "moe", "mla", "real")
REAL_MODEL = Path(__file__).resolve().parent / ".models" / "smollm2-135m-instruct" / "hf"


def make_model(size: str, folder: Path) -> Path:
    """Write (once) the random-weight model ``size`` into ``folder``; returns the folder. For
    ``real``, the real model's folder (``folder`` unused)."""
    if size == "real":
        if not (REAL_MODEL / "config.json").is_file():
            raise SystemExit(
                f"the real model is not at {REAL_MODEL}: run .venv/bin/python "
                "benchmarks/real_model.py first (once)"
            )
        return REAL_MODEL
    if (folder / "config.json").is_file():
        return folder
    return write_tiny_model(folder, MODEL_SPECS[size], dtype=MODEL_DTYPES[size])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("size", choices=sorted(MODEL_SPECS))
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    print(make_model(args.size, args.folder))


if __name__ == "__main__":
    main()
