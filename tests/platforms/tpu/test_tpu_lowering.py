"""Every tpu kernel lowers for a TPU: ``jax.export(..., platforms=["tpu"])`` runs the Pallas to
Mosaic lowering, which rejects block shapes and layouts a TPU cannot tile, without a TPU. (What
only libtpu's compiler checks, it cannot: see platforms/tpu/README.md.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export

from octavo_tpu.kernels import attention, rms_norm, sampler

S = jax.ShapeDtypeStruct
DTYPES = (jnp.float32, jnp.bfloat16)


def lower_for_tpu(fn, *args) -> export.Exported:
    exported = export.export(jax.jit(fn), platforms=["tpu"])(*args)
    assert exported.platforms == ("tpu",)
    assert b"tpu_custom_call" in exported.mlir_module_serialized  # the Mosaic kernel is in it
    return exported


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "heads",
    ((8, 4, 8), (8, 2, 64), (4, 1, 128), (12, 4, 24)),
    ids=lambda h: "h{}kv{}d{}".format(*h),
)
@pytest.mark.parametrize("window", (None, 5), ids=("full", "window"))
@pytest.mark.parametrize("block_size", (16, 128))
def test_paged_attention_lowers(dtype, heads, window, block_size):
    num_heads, num_kv_heads, head_dim = heads
    fn = functools.partial(attention.paged_attention, scale=0.125, window=window)
    lower_for_tpu(
        fn,
        S((32, num_heads, head_dim), dtype),
        S((2, 64, num_kv_heads, block_size, head_dim), dtype),
        S((32,), jnp.int32),
        S((32,), jnp.int32),
        S((8, 16), jnp.int32),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fused", (False, True), ids=("plain", "fused-add"))
@pytest.mark.parametrize("shape", ((16, 64), (5, 4096), (128, 48)), ids=str)
def test_rms_norm_lowers(dtype, fused, shape):
    args = [S(shape, dtype), S(shape[-1:], dtype)] + ([S(shape, dtype)] if fused else [])
    lower_for_tpu(functools.partial(rms_norm.rms_norm, eps=1e-6), *args)


@pytest.mark.parametrize("all_greedy", (False, True), ids=("random", "greedy"))
@pytest.mark.parametrize("rows,vocab", ((8, 512), (3, 32000), (64, 151936)), ids=str)
def test_sampler_lowers(all_greedy, rows, vocab):
    fn = functools.partial(sampler.sample, all_greedy=all_greedy)
    args = [S((rows, vocab), jnp.float32), S((rows,), jnp.float32), S((rows,), jnp.int32)]
    args += [S((rows,), jnp.float32), S((rows,), jnp.float32), S((rows, 2), jnp.uint32)]
    lower_for_tpu(fn, *args)


def test_cache_writes_and_block_copies_lower():
    """The KV write (through ``slot_mapping``) and block copies are XLA scatters and gathers."""
    cache = S((2, 64, 4, 16, 8), jnp.bfloat16)
    export.export(jax.jit(attention.write_kv), platforms=["tpu"])(
        cache, S((32, 4, 8), jnp.bfloat16), S((32, 4, 8), jnp.bfloat16), S((32,), jnp.int32)
    )
    export.export(jax.jit(attention.copy_blocks), platforms=["tpu"])(
        cache, S((3,), jnp.int32), S((3,), jnp.int32)
    )


def test_lowering_rejects_a_block_a_tpu_cannot_tile():
    """The check has teeth: a (3, 100) block of a (9, 300) array is neither whole nor a
    multiple of the (8, 128) tile, and the lowering says so."""
    from jax.experimental import pallas as pl

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    block = pl.BlockSpec((3, 100), lambda i, j: (i, j))
    fn = pl.pallas_call(
        copy,
        grid=(3, 3),
        in_specs=[block],
        out_specs=block,
        out_shape=S((9, 300), jnp.float32),
    )
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        lower_for_tpu(fn, S((9, 300), jnp.float32))
