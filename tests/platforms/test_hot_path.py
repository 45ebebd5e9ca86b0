"""The resolved kernels are plain callables: calling them goes through no pluggy hook."""

from __future__ import annotations

import torch

from octavo.platform import AttentionMetadata, AttentionSpec, Platform, SamplingMetadata


def test_calling_resolved_kernels_calls_no_hook():
    platform = Platform.select(device="cpu")
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=4, scale=8**-0.5
    )
    backend = platform.attention_backend(spec)
    rms_norm = platform.rms_norm(32, 1e-5, torch.float32)
    sampler = platform.sampler(50)

    hook_calls: list[str] = []
    undo = platform.pm.add_hookcall_monitoring(
        before=lambda name, impls, kwargs: hook_calls.append(name), after=lambda *args: None
    )
    try:
        # A resolution that is already cached goes through no hook either.
        assert platform.attention_backend(spec) is backend
        kv_cache = torch.zeros(backend.kv_cache_shape(4))
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
            seq_lens=torch.tensor([3, 2], dtype=torch.int32),
            block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
            slot_mapping=torch.tensor([0, 1, 2, 9], dtype=torch.int64),
            max_query_len=3,
            max_seq_len=3,
        )
        q = torch.randn(4, 4, 8)
        k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
        for _ in range(3):
            out = backend.forward(q, k, v, kv_cache, metadata)
            y, residual = rms_norm(torch.randn(4, 32), torch.ones(32), torch.randn(4, 32))
            tokens = sampler(
                torch.randn(2, 50),
                SamplingMetadata(
                    temperature=torch.tensor([0.0, 1.0]),
                    top_k=torch.tensor([0, 5], dtype=torch.int32),
                    top_p=torch.tensor([1.0, 0.9]),
                    min_p=torch.tensor([0.0, 0.0]),
                    no_top_k=False,
                    no_top_p=False,
                ),
            )
        assert out.shape == q.shape and y.shape == residual.shape and tokens.shape == (2,)
    finally:
        undo()
    assert hook_calls == []


def test_fp8_layers_and_the_rejection_sampler_call_no_hook():
    """Quantising resolves ``scaled_mm`` once; products afterwards, and a resolved verifier's
    calls, go through no hook."""
    from octavo.models.layers.fp8 import quantize_model
    from octavo.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    platform = Platform.select(device="cpu")
    kw = dict(dtype=torch.float32, device="cpu")
    gate_up, down = (
        MergedColumnParallelLinear(16, (32, 32), False, **kw),
        RowParallelLinear(32, 16, True, **kw),
    )
    for layer in (gate_up, down):
        torch.nn.init.normal_(layer.weight)
    quantize_model(torch.nn.ModuleList([gate_up, down]), platform, "fp8")
    verify = platform.rejection_sampler()

    hook_calls: list[str] = []
    undo = platform.pm.add_hookcall_monitoring(
        before=lambda name, impls, kwargs: hook_calls.append(name), after=lambda *args: None
    )
    try:
        for _ in range(2):
            gate, up = gate_up.forward_parts(torch.randn(3, 16))
            y = down(gate * up)
            out = verify(
                torch.tensor([1, 2]),
                [2],
                None,
                torch.softmax(torch.randn(3, 8), -1),
                torch.ones(1),
                torch.rand(2),
                torch.ones(1, 8),
            )
        assert y.shape == (3, 16) and out.shape == (1, 3)
    finally:
        undo()
    assert hook_calls == []


def test_the_monitor_does_see_hook_calls():
    """Test of the test: a resolution that is not cached yet is a hook call and is seen."""
    platform = Platform.select(device="cpu")
    hook_calls: list[str] = []
    undo = platform.pm.add_hookcall_monitoring(
        before=lambda name, impls, kwargs: hook_calls.append(name), after=lambda *args: None
    )
    try:
        platform.rms_norm(64, 1e-6, torch.float32)
    finally:
        undo()
    assert hook_calls == ["octavo_rms_norm"]
