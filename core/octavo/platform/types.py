"""The values that cross the plugin contract: what platforms report and what kernels take."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import torch


@dataclasses.dataclass(frozen=True)
class PlatformInfo:
    """What one platform plugin found when asked to detect its hardware.

    ``priority`` orders available platforms (highest wins); ``reason`` says why the platform is or
    is not available, in words a user can act on.
    """

    name: str
    device_type: str
    available: bool
    priority: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a platform's kernels and device support."""

    dtypes: tuple[torch.dtype, ...]
    block_sizes: tuple[int, ...]
    supports_fp8: bool = False
    supports_graphs: bool = False
    dist_backend: str = "gloo"
    pin_host_memory: bool = False
    """Whether host staging buffers (a step's inputs, swapped-out KV blocks) are allocated in
    page-locked memory, so copies to the device can run asynchronously. True for devices that
    are not the host and whose runtime can pin (CUDA, ROCm); False when the device is the host
    (pinning needs an accelerator runtime and buys nothing there)."""
    widened_matmul_dtypes: tuple[torch.dtype, ...] = ()
    """Model dtypes whose linear layers run in float32 over weights widened once at load, with
    outputs rounded back (same numbers, see ``octavo.models.layers.widen``): for hosts whose
    native matmul in that dtype is slow, e.g. bfloat16 on CPUs without AVX512-BF16 or AMX."""


@dataclasses.dataclass(frozen=True)
class MemoryInfo:
    """Device memory in bytes, as the platform reports it for KV-cache sizing."""

    total: int
    free: int
    used: int


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The shape of one model's attention, given to ``octavo_attention_backend``."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    scale: float
    sliding_window: Optional[int] = None


@dataclasses.dataclass
class AttentionMetadata:
    """One step's flat mixed batch, as the attention kernel sees it.

    The batch holds ``R`` requests and ``T`` new tokens. Request ``r`` owns the new tokens
    ``query_start_loc[r]:query_start_loc[r+1]``; its context after this step is ``seq_lens[r]``
    tokens, so its new tokens sit at positions ``seq_lens[r] - query_len .. seq_lens[r] - 1`` and
    attend causally to everything up to their own position. ``block_table[r, i]`` is the physical
    block holding the request's logical block ``i``; ``slot_mapping[t]`` is the physical slot
    (``block * block_size + offset``) where new token ``t``'s K/V is written, or -1 to skip.
    Host copies of the small scalars let kernels size launches without a device sync.
    """

    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [T] int64
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int = -1  # T without padding; -1 means all of query
    num_context_tokens: int = -1  # the sum of seq_lens, from the host; -1 when not known

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])


class AttentionBackend:
    """A platform's paged attention: it owns the KV cache layout and the kernel.

    The core allocates one KV cache tensor per layer with ``kv_cache_shape`` and only ever
    touches it through this object (forward, block copies for copy-on-write, swap to host).
    The default layout is ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V); a
    backend that wants another layout overrides ``kv_cache_shape`` and ``block_dim``.
    """

    name: str = "base"
    block_dim: int = 1

    def __init__(self, spec: AttentionSpec):
        self.spec = spec

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        s = self.spec
        return (2, num_blocks, s.block_size, s.num_kv_heads, s.head_dim)

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write the new K/V through ``slot_mapping``, then attend through ``block_table``."""
        raise NotImplementedError

    def copy_blocks(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks ``src[i] -> dst[i]`` inside one layer's cache (copy-on-write)."""
        index = [slice(None)] * kv_cache.dim()
        src_index, dst_index = list(index), list(index)
        src_index[self.block_dim], dst_index[self.block_dim] = src, dst
        kv_cache[tuple(dst_index)] = kv_cache[tuple(src_index)]

    def swap_blocks(
        self, src_cache: torch.Tensor, dst_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Copy blocks between two caches of this layout (device <-> host swap)."""
        index = [slice(None)] * src_cache.dim()
        src_index, dst_index = list(index), list(index)
        src_index[self.block_dim] = src.to(src_cache.device)
        dst_index[self.block_dim] = dst.to(dst_cache.device)
        dst_cache[tuple(dst_index)] = src_cache[tuple(src_index)].to(dst_cache.device)


@dataclasses.dataclass(frozen=True)
class MLASpec:
    """One model's multi-head latent attention (DeepSeek-V2/V3), given to
    ``octavo_mla_attention_backend``.

    The KV cache holds one row per token: its compressed latent (``kv_lora_rank`` wide, after
    the model's norm) then its rotary key part (``qk_rope_head_dim``), shared by every head.
    Attention runs in the latent space (the queries already absorbed the key up-projection):
    query row ``[num_heads, kv_lora_rank + qk_rope_head_dim]`` against each cached row; the
    value of a cached token is its latent, so the output is ``[num_heads, kv_lora_rank]``.
    """

    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype
    block_size: int
    scale: float

    @property
    def row_width(self) -> int:
        """Elements per token and layer in the cache: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class MLAAttentionBackend(AttentionBackend):
    """A platform's paged multi-head latent attention (``octavo_mla_attention_backend``).

    Layout ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` (one row per token;
    ``block_dim`` 0); the block copies and swaps of :class:`AttentionBackend` apply as they are.
    The oracle is ``octavo.ops.reference.mla_attention``.
    """

    block_dim: int = 0

    def __init__(self, spec: MLASpec):
        self.spec = spec

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.spec.block_size, self.spec.row_width)

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,  # [T, num_heads, kv_lora_rank + qk_rope_head_dim]
        kv_row: torch.Tensor,  # [T, kv_lora_rank + qk_rope_head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, kv_lora_rank]
        """Write each new token's row through ``slot_mapping``, then attend causally through
        ``block_table``: scores ``query . row * scale``, softmax in float32, the weighted sum
        of the rows' latents; returned in ``query.dtype``."""
        raise NotImplementedError

    def write_rows(
        self, kv_row: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        """Write each new token's row through ``slot_mapping`` without attending: the model's
        expanded (prefill) form reads the rows back itself. The layout above is the contract,
        so the default serves every backend that keeps it."""
        from octavo.ops.reference_mla import write_mla_rows

        write_mla_rows(kv_row, kv_cache, metadata.slot_mapping)


@dataclasses.dataclass
class SamplingMetadata:
    """Per-row sampling parameters for one step's logits ``[R, V]``, as tensors.

    ``temperature`` 0 means greedy for that row; ``top_k`` 0 means no top-k; ``top_p`` 1.0 and
    ``min_p`` 0.0 mean off. ``generators`` maps a row index to its request's seeded
    ``torch.Generator``; rows without one draw from the global generator. ``all_greedy`` and
    ``all_random`` let kernels skip work without inspecting tensors on the host.
    """

    temperature: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int32
    top_p: torch.Tensor  # [R] float32
    min_p: torch.Tensor  # [R] float32
    generators: dict[int, torch.Generator] = dataclasses.field(default_factory=dict)
    all_greedy: bool = False
    all_random: bool = False
    no_top_k: bool = True
    no_top_p: bool = True
    no_min_p: bool = True


# Kernel callables a platform returns. Plain callables: the hot path never goes through pluggy.
RMSNormFn = Callable[..., Any]
"""``fn(x, weight, residual=None)``: ``rms_norm(x) * weight``, or with ``residual``:
``(rms_norm(x + residual) * weight, x + residual)``."""

SamplerFn = Callable[[torch.Tensor, SamplingMetadata], torch.Tensor]
"""``fn(logits [R, V] float32, metadata) -> token ids [R] int64``."""

BitmaskFn = Callable[..., None]
"""``fn(logits [R, V], bitmask [R, ceil(V/32)] int32, indices=None)``: in place, logits whose
bit is 0 become ``-inf``; ``indices`` selects the logits rows the bitmask rows apply to."""

ScaledMMFn = Callable[..., torch.Tensor]
"""``fn(a, b, scale_a, scale_b, out_dtype, bias=None)``: ``(a @ b) * scale_a * scale_b (+ bias)``
with FP8 inputs; scales are per-tensor ``[1]``, per-token ``[M, 1]`` or per-channel ``[1, N]``."""

RotaryFn = Callable[[Any, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
"""``fn((cos, sin), query [T, H*D], key [T, KVH*D], head_dim) -> (query [T, H, D], key [T, KVH,
D])``: the step's rotary embedding (``octavo.ops.reference.rotary_embedding``). A kernel may
rotate ``query`` and ``key`` in place: the model passes views of its own qkv projection."""

SiluAndMulFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``fn(gate [T, I], up [T, I]) -> silu(gate) * up [T, I]`` in their dtype."""


@dataclasses.dataclass(frozen=True)
class LoRAMapping:
    """Which LoRA slot each of a step's tokens reads, built once per step by the model runner
    (``octavo.lora.mapping``) and shared by every LoRA layer of the step.

    ``token_slots [T]`` (int64, on the device): the slot of each token, -1 for the base model.
    The same, grouped: ``sorted_tokens [T_lora]`` (int64, on the device) lists the tokens that
    have an adapter, those of one slot together; group ``g`` is slot ``segment_slots[g]`` and
    holds ``sorted_tokens[segment_starts[g] : segment_starts[g + 1]]``. The segments are also
    on the host as tuples (``host_segment_slots``, ``host_segment_starts``) for kernels that
    loop over them there; ``max_segment_length`` is the longest.
    """

    token_slots: torch.Tensor
    sorted_tokens: torch.Tensor
    segment_slots: torch.Tensor
    segment_starts: torch.Tensor
    host_segment_slots: tuple[int, ...]
    host_segment_starts: tuple[int, ...]
    max_segment_length: int

    @property
    def num_tokens(self) -> int:
        return int(self.token_slots.shape[0])


class LoRAKernels(Protocol):
    """The batched LoRA products of a platform (``octavo_lora_kernels``); the reference is
    ``octavo.ops.reference.lora_shrink`` / ``lora_expand``. ``S`` slots, rank ``R`` (adapters
    of a lower rank zero-padded), the adapters' scaling folded into ``b_stacked``."""

    def shrink(
        self, x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRAMapping
    ) -> torch.Tensor:
        """``x [T, K]`` (model dtype), ``a_stacked [S, R, K]`` -> ``[T, R]`` float32: row ``t``
        is ``x[t] @ a_stacked[slot(t)].T``; a row without an adapter is zeros."""
        ...

    def expand(
        self,
        y: torch.Tensor,
        buffer: torch.Tensor,
        b_stacked: torch.Tensor,
        mapping: LoRAMapping,
        offset: int,
    ) -> None:
        """Add ``buffer[t] @ b_stacked[slot(t)].T`` into ``y[t, offset : offset + N]`` in place
        for every token with an adapter (``buffer [T, R]`` float32, possibly a column slice of
        a wider buffer; ``b_stacked [S, N, R]``; ``y [T, >= offset + N]`` in the model dtype,
        rounded once); rows without an adapter are left untouched."""
        ...


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """One Mixture-of-Experts layer's routing and shape (``octavo_fused_moe``).

    Routing: ``scoring`` (``"softmax"`` or ``"sigmoid"``) of the router logits in float32; each
    token's ``top_k`` experts by score, DeepSeek's grouped choice when ``num_expert_groups``
    > 1 (the experts in ``num_expert_groups`` equal groups, a group scored by ``group_score``:
    ``"top2_sum"``, the sum of its two best experts, DeepSeek-V3's; ``"max"``, its best
    expert, DeepSeek-V2's ``group_limited_greedy``; only the ``topk_groups`` best groups'
    experts eligible; with a correction bias the choice reads ``score + bias``, the weights the
    plain scores); the chosen weights renormalised to sum 1 when ``renormalize``, then times
    ``routed_scaling_factor``.

    Experts: ``num_experts`` of ``hidden_size -> intermediate_size`` (this rank's share of each
    expert's inner width under tensor parallelism) with activation ``activation`` (``"silu"``:
    ``silu(gate) * up``); each token's output is the sum of its experts' outputs times their
    weights. ``dtype`` is the model's.
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype
    scoring: str = "softmax"
    renormalize: bool = True
    num_expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    activation: str = "silu"
    group_score: str = "top2_sum"

    SCORINGS = ("softmax", "sigmoid")
    GROUP_SCORES = ("top2_sum", "max")
    ACTIVATIONS = ("silu",)

    def __post_init__(self) -> None:
        if self.scoring not in self.SCORINGS:
            raise ValueError(f"MoE scoring {self.scoring!r}: use one of {self.SCORINGS}")
        if self.activation not in self.ACTIVATIONS:
            raise ValueError(f"MoE activation {self.activation!r}: use one of {self.ACTIVATIONS}")
        if self.group_score not in self.GROUP_SCORES:
            raise ValueError(
                f"MoE group_score {self.group_score!r}: use one of {self.GROUP_SCORES}"
            )
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"MoE top_k {self.top_k} must be in 1..{self.num_experts}")
        if self.num_experts % self.num_expert_groups or not (
            0 < self.topk_groups <= self.num_expert_groups
        ):
            raise ValueError(
                f"MoE groups: {self.num_experts} experts in {self.num_expert_groups} groups, "
                f"{self.topk_groups} chosen: the groups must divide the experts and "
                "1 <= topk_groups <= num_expert_groups"
            )


class FusedMoEFn(Protocol):
    """A Mixture-of-Experts layer over expert weights packed at load (``FusedMoEPacker``)."""

    def __call__(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor,
        correction_bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``hidden [T, H]`` (model dtype), ``router_logits [T, E]`` -> ``[T, H]`` in the model
        dtype: each token routed and its experts applied as :class:`MoESpec` says (the
        reference: ``octavo.ops.reference.fused_moe``). ``correction_bias [E]`` float32, where
        the model has one, shifts the choice of experts only. Under tensor parallelism the
        result is this rank's partial sum (the model all-reduces it)."""
        ...


FusedMoEPacker = Callable[[torch.Tensor, torch.Tensor], FusedMoEFn]
"""``pack(w13 [E, 2 * I, H], w2 [E, H, I]) -> FusedMoEFn``: called once per MoE layer at load
with its stacked expert weights (rows ``0 .. I - 1`` of ``w13[e]`` expert ``e``'s gate
projection, rows ``I .. 2I - 1`` its up projection; ``w2[e]`` its down projection); the
platform may keep them in its own layout."""


LinearPacker = Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]
"""``pack(weight [N, K]) -> fn(x [M, K]) -> x @ weight.T [M, N]``: called once per weight at load
(the platform may keep a copy in its own layout); ``fn`` must give ``F.linear``'s numbers."""

QuantizedLinearPacker = Callable[[torch.Tensor, int], Callable[[torch.Tensor], torch.Tensor]]
"""``pack(raw uint8 [N, row_bytes], in_features K) -> fn(x [..., K]) -> [..., N]`` in ``x``'s
dtype: a weight kept in one quantized row format (``octavo.quantization.quant_types``), packed
once at load. ``fn`` approaches ``octavo.ops.reference.quantized_linear`` within the budget of
the conformance suite (it may quantize ``x`` to 8 bits per block of 32 on the way)."""


class RejectionSamplerFn(Protocol):
    """The speculative-decoding verifier: lossless rejection sampling of draft tokens.

    The batch holds ``R`` requests; request ``r`` proposes ``k_r = num_draft_tokens[r]`` draft
    tokens (``N = sum(k_r)``, flat in request order; ``k_r`` may be 0). The target model scored
    ``k_r + 1`` positions per request: its draft positions, then the bonus position after the
    last draft, so ``target_probs`` has ``N + R`` rows with request ``r``'s starting at row
    ``cu_r + r`` (``cu_r = k_0 + ... + k_{r-1}``). Probabilities are float32 and already
    reflect the request's temperature and top-k/top-p (the draft's likewise).

    Request ``r`` with ``temperature[r] == 0`` verifies greedily: a draft is accepted while it is
    the target's argmax (lowest index on ties); the first mismatch is replaced by the argmax, or
    when all are accepted the bonus position's argmax follows. Other requests accept draft
    ``x`` at position ``i`` when ``uniforms[i] * q_i(x) < p_i(x)`` (``q`` the draft's
    probabilities, a point mass on ``x`` when ``draft_probs`` is None, as for n-gram drafts);
    at the first rejection the token is recovered from ``max(p_i - q_i, 0)`` renormalised (``p_i``
    when that is all zero), and when all are accepted a bonus token is drawn from the bonus
    position's ``p``. Either draw is the exponential race ``argmax(weights / noise[r])``, so the
    emitted tokens follow the target distribution exactly, whatever the draft proposed.

    Randomness comes in as tensors (``uniforms [N]``, ``noise [R, V]`` of Exp(1) draws; see
    ``octavo.ops.reference.draw_rejection_randoms`` for per-request seeded generators), so a
    kernel is deterministic and its result equals the reference's for the same draws. Every
    input is read only: an all-greedy step's stand-in draws are shared between steps.

    Returns ``[R, max(k_r) + 1]`` int64: row ``r`` holds its accepted drafts, then the
    recovered or bonus token, then -1 padding (``1 + accepted`` tokens per row).
    """

    def __call__(
        self,
        draft_token_ids: torch.Tensor,  # [N] int64
        num_draft_tokens: Sequence[int],  # [R], on the host: sizes the output without a sync
        draft_probs: Optional[torch.Tensor],  # [N, V] float32, or None (a point mass on each draft)
        target_probs: torch.Tensor,  # [N + R, V] float32
        temperature: torch.Tensor,  # [R] float32; 0 = greedy verification
        uniforms: torch.Tensor,  # [N] float32 in [0, 1)
        noise: torch.Tensor,  # [R, V] float32, Exp(1)
    ) -> torch.Tensor: ...


@runtime_checkable
class Communicator(Protocol):
    """Collective operations for one process group."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor: ...

    def send(self, tensor: torch.Tensor, dst: int) -> None: ...

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor: ...


@runtime_checkable
class EngineRunner(Protocol):
    """What the engine core calls on a model runner: the core's ``ModelRunner``, a
    ``MultiprocExecutor`` of tensor-parallel workers, or a platform's own (the
    ``octavo_model_runner`` hook)."""

    recompute_last_cached_block: bool
    """True when a prefix-cache hit must leave its last block to be recomputed (a draft
    model needs that block's hidden states)."""

    def plan_kv_cache(self, cache_config: Any) -> Any:
        """The ``KVCacheSizing`` this runner's memory allows (``octavo.kv_cache.sizing``)."""

    def initialize_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        """Allocate the paged cache (and the host cache swapped-out blocks go to)."""

    def enable_structured_output(self, backend: Callable[[], Any]) -> None:
        """Constrain requests with ``structured_outputs`` (``backend()`` gives the grammars)."""

    def execute_model(self, scheduler_output: Any) -> Any:
        """Run one ``SchedulerOutput``; return its ``ModelRunnerOutput``. A ``RequestError``
        blames some requests (the runner then holds none; the scheduler restarts the rest)."""

    def check_alive(self) -> Optional[str]:
        """Why this runner cannot step any more, or None."""

    def shutdown(self) -> None:
        """Stop what the runner started; idempotent."""
