"""KV cache sizing from the memory budget and the model's shape."""

from __future__ import annotations

import pytest
import torch

from octavo.config import CacheConfig
from octavo.errors import ConfigError
from octavo.kv_cache.sizing import bytes_per_block, check_block_size, num_gpu_blocks, plan_kv_cache
from octavo.platform.types import Capabilities, MemoryInfo

GiB = 1 << 30


def test_bytes_per_block():
    # Llama-3-8B: 32 layers, 8 kv heads, head_dim 128, bf16, block 16 -> 2 MiB per block
    assert bytes_per_block(32, 16, 8, 128, torch.bfloat16) == 2 * 32 * 16 * 8 * 128 * 2 == 2 << 20
    assert bytes_per_block(2, 1, 1, 4, torch.float32) == 64


@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 64, 128])
def test_block_sizes_accepted(block_size):
    assert check_block_size(block_size) == block_size


def test_block_size_must_be_supported_by_core_and_platform():
    with pytest.raises(ConfigError, match="choose --block-size from 1, 8, 16, 32, 64, 128"):
        check_block_size(24)
    with pytest.raises(ConfigError, match="from 16, 32, 64, 128"):
        check_block_size(8, platform_block_sizes=(16, 32, 64, 128))


def test_budget_from_utilization_or_explicit_memory():
    block = 1 << 20
    assert (
        num_gpu_blocks(
            block_bytes=block,
            total_memory=10 * GiB,
            model_memory=1 * GiB,
            gpu_memory_utilization=0.5,
        )
        == 4096
    )
    assert (
        num_gpu_blocks(
            block_bytes=block, total_memory=10 * GiB, model_memory=9 * GiB, kv_cache_memory=GiB
        )
        == 1024
    )


def test_too_small_a_budget_says_how_much_is_needed():
    block = 1 << 20
    with pytest.raises(
        ConfigError, match=r"needs 256 blocks \(0.25 GiB\).*gpu-memory-utilization to at least 0.93"
    ):
        num_gpu_blocks(
            block_bytes=block,
            total_memory=10 * GiB,
            model_memory=9 * GiB,
            gpu_memory_utilization=0.9,
            block_size=16,
            max_model_len=4096,
        )
    with pytest.raises(ConfigError, match="kv-cache-memory to at least 0.25 GiB"):
        num_gpu_blocks(
            block_bytes=block,
            total_memory=GiB,
            model_memory=0,
            kv_cache_memory=GiB // 8,
            max_model_len=4096,
        )


def test_plan_kv_cache_for_a_platform():
    caps = Capabilities(dtypes=(torch.float32,), block_sizes=(16, 32))
    memory = MemoryInfo(total=8 * GiB, free=8 * GiB, used=0)
    plan = plan_kv_cache(
        CacheConfig(block_size=32, kv_cache_memory=GiB, swap_space=0.5),
        caps,
        memory,
        model_memory=GiB,
        num_layers=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
        max_model_len=2048,
    )
    assert plan.block_bytes == 2 * 4 * 32 * 2 * 64 * 4
    assert (
        plan.num_gpu_blocks == GiB // plan.block_bytes
        and plan.num_host_blocks == GiB // 2 // plan.block_bytes
    )
    with pytest.raises(ConfigError, match="from 16, 32"):
        plan_kv_cache(
            CacheConfig(block_size=8),
            caps,
            memory,
            model_memory=0,
            num_layers=1,
            num_kv_heads=1,
            head_dim=8,
            dtype=torch.float32,
            max_model_len=16,
        )
