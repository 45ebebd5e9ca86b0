"""Sizing one model runner's KV cache from its own memory (each tensor-parallel rank sizes its
own, for the KV heads it holds; the engine takes the smallest)."""

from __future__ import annotations

import logging

from octavo.config import CacheConfig
from octavo.kv_cache.sizing import KVCacheSizing, plan_kv_cache

logger = logging.getLogger(__name__)


def plan_runner_kv_cache(runner, cache_config: CacheConfig) -> KVCacheSizing:
    """Size ``runner``'s KV cache: ``kv_cache_memory`` bytes when given (the cpu platform always
    sets it), else what ``gpu_memory_utilization`` leaves after the weights and the peak
    activations of a profile run. The profile run is skipped when its figure is not used: on
    the host CPU a max-size step of the ~100M model costs tens of seconds of start-up."""
    activation_bytes = 0
    if cache_config.kv_cache_memory is None:
        activation_bytes = runner.profile_run().peak_activation_bytes
    platform, mc = runner.platform, runner.model_config
    return plan_kv_cache(
        cache_config,
        platform.capabilities,
        platform.memory_info(runner.device),
        model_memory=runner.parameter_bytes() + activation_bytes,
        num_layers=mc.num_hidden_layers,
        num_kv_heads=runner.tp.kv_heads(mc.num_key_value_heads)[1],
        head_dim=mc.head_dim,
        dtype=mc.dtype,
        max_model_len=mc.max_model_len,
        extra_block_bytes=_proposer_block_bytes(runner),
        layout_block_bytes=runner.kv_cache_bytes_per_block(_target_layers(runner)),
    )


def _target_layers(runner) -> list:
    """The target model's attention layers (a draft model's are counted apart)."""
    speculation = runner.speculation
    drafts = set() if speculation is None else set(map(id, speculation.proposer.attention_layers))
    return [layer for layer in runner.attention_layers if id(layer) not in drafts]


def _proposer_block_bytes(runner) -> int:
    """KV bytes per block of a draft model's layers, which share the target's block ids."""
    speculation = runner.speculation
    if speculation is None or not speculation.proposer.attention_layers:
        return 0
    return runner.kv_cache_bytes_per_block(speculation.proposer.attention_layers)
