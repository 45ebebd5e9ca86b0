"""The cpu platform's configure hook: a bounded default KV cache on a shared host."""

from __future__ import annotations

from octavo.config import EngineArgs
from octavo.platform import Platform


def test_cpu_defaults_the_kv_cache_to_a_bounded_size():
    platform = Platform.select(device="cpu")
    overrides = platform.configure(EngineArgs(model="m"))
    assert 0 < overrides["kv_cache_memory"] <= 4 << 30


def test_an_explicit_kv_cache_size_wins():
    platform = Platform.select(device="cpu")
    assert platform.configure(EngineArgs(model="m", kv_cache_memory="256MiB")) == {}
