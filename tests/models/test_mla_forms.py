"""Multi-head latent attention's two forms (:mod:`octavo.models.layers.mla`): each, pinned
through ``OCTAVO_MLA_FORM``, gives transformers' greedy tokens through chunked prefill and mixed
batches; the per-step choice picks the expanded form for prefills and the absorbed for decodes."""

from __future__ import annotations

import pytest
import torch
from model_cases import PROMPTS, TINY_SPECS
from test_greedy import run_greedy

from octavo.errors import ConfigError
from octavo.models.layers.mla import (
    DeepseekAttention,
    context_rows,
    mla_form_from_env,
    prefers_expanded,
)
from octavo.platform.types import AttentionMetadata

DEEPSEEK = "DeepseekV3ForCausalLM"
V3_DIMS = (128, 128, 512)  # DeepSeek-V3's qk_nope_head_dim, v_head_dim, kv_lora_rank


def metadata(query_lens, seq_lens, block_size=4, known=True) -> AttentionMetadata:
    """A step's metadata with each request's blocks laid out consecutively."""
    blocks = [-(-n // block_size) for n in seq_lens]
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    first = 0
    for r, n in enumerate(blocks):
        table[r, :n] = torch.arange(first, first + n)
        first += n
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    return AttentionMetadata(
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_context_tokens=sum(seq_lens) if known else -1,
    )


@pytest.mark.parametrize(
    "query_lens, seq_lens, expanded",
    [
        ((512,), (512,), True),  # a fresh prompt
        ((256,), (1024,), True),  # a chunk after a prefix-cache hit
        ((1,) * 32, (900,) * 32, False),  # decodes
        ((1,) * 31 + (64,), (900,) * 31 + (64,), False),  # decodes beside a short prefill
        ((1,) * 3 + (2048,), (900,) * 3 + (2048,), True),  # a long prefill beside a few decodes
    ],
)
def test_the_cheaper_form_is_chosen_per_step(query_lens, seq_lens, expanded):
    step = metadata(query_lens, seq_lens)
    assert prefers_expanded(step, sum(query_lens), V3_DIMS) is expanded


def test_without_host_context_counts_the_absorbed_form_serves():
    step = metadata((512,), (512,), known=False)
    assert prefers_expanded(step, 512, V3_DIMS) is False


def test_a_misspelt_form_fails_loudly(monkeypatch):
    monkeypatch.setenv("OCTAVO_MLA_FORM", "expand")
    with pytest.raises(ConfigError, match="OCTAVO_MLA_FORM='expand'"):
        mla_form_from_env()


def test_context_rows_follow_each_block_table():
    step = metadata((1, 3), (6, 3), block_size=4)
    step.block_table = torch.tensor([[5, 2], [7, 0]], dtype=torch.int32)
    cache = torch.arange(8 * 4, dtype=torch.float32).view(8, 4, 1)
    rows = context_rows(cache, step).flatten().tolist()
    assert rows == [20, 21, 22, 23, 8, 9, 28, 29, 30]


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
@pytest.mark.parametrize("chunk_size", [None, 7], ids=["whole", "chunk7"])
def test_each_form_matches_transformers(
    form, chunk_size, monkeypatch, tiny_models, make_runner, oracle
):
    monkeypatch.setenv("OCTAVO_MLA_FORM", form)
    calls = {"absorbed": 0, "expanded": 0}
    for name in calls:
        method = getattr(DeepseekAttention, f"_{name}_attention")

        def counted(self, *args, _method=method, _name=name):
            calls[_name] += 1
            return _method(self, *args)

        monkeypatch.setattr(DeepseekAttention, f"_{name}_attention", counted)
    path = tiny_models[DEEPSEEK]
    runner = make_runner(path, block_size=16)
    assert DEEPSEEK in TINY_SPECS
    outputs = run_greedy(runner, PROMPTS, 24, chunk_size)
    assert outputs == [oracle.greedy(path, p, 24) for p in PROMPTS]
    assert calls[form] > 0 and sum(calls.values()) == calls[form], calls


def test_auto_expands_prefills_and_absorbs_decodes(monkeypatch, tiny_models, make_runner):
    monkeypatch.delenv("OCTAVO_MLA_FORM", raising=False)
    chosen = []
    original = DeepseekAttention._expanded

    def record(self, attn_metadata, tokens):
        chosen.append((attn_metadata.max_query_len, original(self, attn_metadata, tokens)))
        return chosen[-1][1]

    monkeypatch.setattr(DeepseekAttention, "_expanded", record)
    run_greedy(make_runner(tiny_models[DEEPSEEK]), PROMPTS[-1:], 4)
    layers = TINY_SPECS[DEEPSEEK].num_hidden_layers
    assert chosen[:layers] == [(len(PROMPTS[-1]), True)] * layers  # the prompt, in one step
    assert chosen[layers:] == [(1, False)] * (len(chosen) - layers) and len(chosen) > layers
