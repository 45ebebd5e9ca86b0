"""Tensor-parallel layers: each rank's weight loader keeps the right slice, so per-rank results
recombine (concatenate or sum) to the unsharded layer's output."""

from __future__ import annotations

import pytest
import torch

from octavo.models.layers.embedding import VocabParallelEmbedding
from octavo.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
)


class UnusedCommunicator:
    """Satisfies TPGroup's requirement; these tests combine the ranks' results themselves."""

    def all_reduce(self, tensor):
        raise AssertionError("not used")

    all_gather = send = recv = all_reduce


def ranks(size: int) -> list[TPGroup]:
    return [TPGroup(size, rank, UnusedCommunicator()) for rank in range(size)]


KW = dict(dtype=torch.float32, device="cpu")


def test_qkv_loads_q_k_v_into_one_fused_weight():
    layer = QKVParallelLinear(16, 4, num_heads=4, num_kv_heads=2, bias=True, **KW)
    parts = {s: torch.randn(n, 16) for s, n in (("q", 16), ("k", 8), ("v", 8))}
    biases = {s: torch.randn(w.shape[0]) for s, w in parts.items()}
    for shard in ("v", "q", "k"):
        layer.weight.weight_loader(layer.weight, parts[shard], shard)
        layer.bias.weight_loader(layer.bias, biases[shard], shard)
    x = torch.randn(3, 16)
    q, k, v = layer.split_qkv(layer(x))
    for name, out in zip("qkv", (q, k, v)):
        torch.testing.assert_close(out, x @ parts[name].T + biases[name])


def test_column_parallel_shards_concatenate_to_the_full_output():
    full = [torch.randn(12, 8), torch.randn(12, 8)]  # gate, up
    x = torch.randn(5, 8)
    outs = []
    for tp in ranks(2):
        layer = MergedColumnParallelLinear(8, (12, 12), False, tp=tp, **KW)
        for i, w in enumerate(full):
            layer.weight.weight_loader(layer.weight, w, i)
        gate, up = layer(x).chunk(2, dim=-1)
        outs.append((gate, up))
    torch.testing.assert_close(torch.cat([g for g, _ in outs], -1), x @ full[0].T)
    torch.testing.assert_close(torch.cat([u for _, u in outs], -1), x @ full[1].T)


def test_row_parallel_partial_products_sum_to_the_full_output():
    weight = torch.randn(6, 8)
    x = torch.randn(5, 8)
    total = 0
    for tp in ranks(2):
        layer = RowParallelLinear(8, 6, False, tp=tp, **KW)
        layer.weight.weight_loader(layer.weight, weight)
        total = total + torch.nn.functional.linear(x.chunk(2, -1)[tp.rank], layer.weight)
    torch.testing.assert_close(total, x @ weight.T)


def test_vocab_parallel_embedding_pads_the_last_shard():
    weight = torch.randn(10, 4)
    shards = []
    for tp in ranks(3):
        layer = VocabParallelEmbedding(10, 4, tp=tp, **KW)
        layer.weight.weight_loader(layer.weight, weight)
        shards.append(layer.weight)
    assert [s.shape[0] for s in shards] == [4, 4, 4]
    torch.testing.assert_close(torch.cat(shards)[:10], weight)
    assert torch.count_nonzero(shards[-1][2:]) == 0


def test_loaders_refuse_tensors_of_the_wrong_shape():
    layer = ColumnParallelLinear(8, (6,), False, **KW)
    with pytest.raises(
        ValueError, match=r"has shape \[6, 7\] but the model config implies \[6, 8\]"
    ):
        layer.weight.weight_loader(layer.weight, torch.randn(6, 7))


def test_uneven_head_split_is_refused():
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size"):
        ColumnParallelLinear(8, (6,), False, tp=ranks(4)[0], **KW)
