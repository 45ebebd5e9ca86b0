"""The octavo plugin contract: every hook a platform or extension plugin may implement.

Conventions (as in pytest's hookspec module): every hook is named ``octavo_*``, has a typed
signature and an empty body. Implementations may accept a subset of the arguments, so adding an
argument never breaks a plugin. ``platform`` is always the chosen platform's
:class:`~octavo.platform.types.PlatformInfo`: an implementation that does not serve that platform
returns ``None`` ("not me").

Hooks are called at start-up only, by :class:`octavo.platform.Platform`, which keeps the plain
callables they return; the per-step hot path never calls ``pm.hook``.

The types the hooks name live beside this module, in :mod:`octavo.platform.types`; imports run
one way (``manager`` -> ``hookspecs`` -> ``types``), and :mod:`octavo.platform` exports both.
"""

from __future__ import annotations

from typing import Any, Optional

import pluggy
import torch

from octavo.platform.types import (
    AttentionBackend,
    AttentionSpec,
    BitmaskFn,
    Capabilities,
    Communicator,
    FusedMoEPacker,
    LinearPacker,
    LoRAKernels,
    MemoryInfo,
    MLAAttentionBackend,
    MLASpec,
    MoESpec,
    PlatformInfo,
    QuantizedLinearPacker,
    RejectionSamplerFn,
    RMSNormFn,
    RotaryFn,
    SamplerFn,
    ScaledMMFn,
    SiluAndMulFn,
)

PROJECT_NAME = "octavo"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --- detection and set-up ------------------------------------------------------------------


@hookspec
def octavo_platform_detect() -> Optional[PlatformInfo]:
    """Say whether this plugin's hardware is present.

    :return: a :class:`PlatformInfo` (available or not, with the reason), or None for a plugin
        that is not a platform.

    Collects every result. Called once per process by platform selection, before any other
    hook. Must not initialise a device runtime (no CUDA context, no TPU client): read
    ``torch.version``, environment variables, device files.
    """


@hookspec(firstresult=True)
def octavo_platform_capabilities(platform: PlatformInfo) -> Optional[Capabilities]:
    """Return the chosen platform's :class:`Capabilities` (dtypes, block sizes, fp8, ...).

    Stops at the first non-None result. Called once at start-up.
    """


@hookspec
def octavo_configure(platform: PlatformInfo, config: Any) -> Optional[dict[str, Any]]:
    """Check and adjust the engine configuration for this platform.

    :param config: the engine configuration (a frozen dataclass).
    :return: a mapping of field overrides, or None for no change. Raise
        :class:`octavo.errors.ConfigError` with the reason when the configuration cannot work.

    Collects every result; later plugins see the original config. Called once at start-up.
    """


@hookspec(firstresult=True)
def octavo_device_init(platform: PlatformInfo, local_rank: int) -> Optional[torch.device]:
    """Initialise the device runtime for ``local_rank`` and return the ``torch.device`` to use.

    Stops at the first non-None result. Called once per worker process.
    """


@hookspec(firstresult=True)
def octavo_memory_info(platform: PlatformInfo, device: torch.device) -> Optional[MemoryInfo]:
    """Return total/free/used memory of ``device`` in bytes, for KV-cache sizing.

    Stops at the first non-None result. Called at start-up, after the profile run.
    """


# --- kernels ----------------------------------------------------------------------------------


@hookspec(firstresult=True)
def octavo_attention_backend(
    platform: PlatformInfo, spec: AttentionSpec
) -> Optional[AttentionBackend]:
    """Return the paged-attention backend for a model's attention shape.

    The backend owns the KV cache layout and writes new K/V through ``slot_mapping`` and reads
    context through ``block_table`` for a flat batch mixing prefill chunks and decodes.

    Stops at the first non-None result (kernel packs use ``tryfirst`` to win). Called once per
    model at start-up.
    """


@hookspec(firstresult=True)
def octavo_mla_attention_backend(
    platform: PlatformInfo, spec: MLASpec
) -> Optional[MLAAttentionBackend]:
    """Return the paged multi-head latent attention backend (DeepSeek-V2/V3's MLA) for a
    model's :class:`MLASpec`: one cache row per token (latent and rotary key), attention in the
    latent space (:class:`~octavo.platform.types.MLAAttentionBackend` states the layout and the
    rule; ``octavo.ops.reference.mla_attention`` is the oracle).

    Optional: without it the core's reference backend serves. Stops at the first non-None
    result. Called once per model at start-up.
    """


@hookspec(firstresult=True)
def octavo_rms_norm(
    platform: PlatformInfo, hidden_size: int, eps: float, dtype: torch.dtype
) -> Optional[RMSNormFn]:
    """Return ``fn(x, weight, residual=None)`` computing RMSNorm with optional fused residual add.

    Without ``residual`` it returns ``rms_norm(x) * weight``; with it, the pair
    ``(rms_norm(x + residual) * weight, x + residual)``.

    Stops at the first non-None result. Called once per distinct norm shape at start-up.
    """


@hookspec(firstresult=True)
def octavo_sampler(platform: PlatformInfo, vocab_size: int) -> Optional[SamplerFn]:
    """Return ``fn(logits, sampling_metadata) -> token_ids``: batched greedy, temperature,
    top-k, top-p and min-p sampling with per-request seeded generators.

    Stops at the first non-None result. Called once at start-up.
    """


@hookspec(firstresult=True)
def octavo_rejection_sampler(platform: PlatformInfo) -> Optional[RejectionSamplerFn]:
    """Return the speculative-decoding verifier (lossless rejection sampling of draft tokens):
    ``fn(draft_token_ids, num_draft_tokens, draft_probs, target_probs, temperature, uniforms,
    noise) -> [R, max_k + 1]`` int64, each request's accepted drafts, then the recovered or bonus
    token, then -1. :class:`~octavo.platform.types.RejectionSamplerFn` states the layout and the
    rule; ``octavo.ops.reference.rejection_sample`` is the oracle. Randomness comes in as tensors,
    so the result is deterministic.

    Stops at the first non-None result. Called once at start-up when speculation is on.
    """


@hookspec(firstresult=True)
def octavo_apply_token_bitmask(platform: PlatformInfo) -> Optional[BitmaskFn]:
    """Return ``fn(logits, bitmask, indices=None)`` that masks disallowed tokens in place.

    Stops at the first non-None result. Called once at start-up when structured output is used.
    """


@hookspec(firstresult=True)
def octavo_scaled_mm(platform: PlatformInfo) -> Optional[ScaledMMFn]:
    """Return the FP8 scaled matmul ``fn(a, b, scale_a, scale_b, out_dtype, bias=None)``.

    Stops at the first non-None result. Called once at start-up when FP8 quantisation is on.
    """


@hookspec(firstresult=True)
def octavo_silu_and_mul(platform: PlatformInfo) -> Optional[SiluAndMulFn]:
    """Return ``fn(gate, up) -> silu(gate) * up`` (the Llama MLP's activation) as one kernel.

    Optional: without it the model composes ``octavo.ops.reference.silu_and_mul``. Stops at the
    first non-None result. Called once at start-up.
    """


@hookspec(firstresult=True)
def octavo_lora_kernels(platform: PlatformInfo, dtype: torch.dtype) -> Optional[LoRAKernels]:
    """Return the batched LoRA shrink/expand products (:class:`LoRAKernels`) for a model of
    ``dtype``: many adapters in one batch, each token reading its own slot's weights.

    Optional: without it LoRA layers use ``octavo.ops.reference.lora_shrink`` / ``lora_expand``
    (a loop over the step's adapters). Stops at the first non-None result. Called once at
    start-up when ``--enable-lora`` is on.
    """


@hookspec(firstresult=True)
def octavo_fused_moe(platform: PlatformInfo, spec: MoESpec) -> Optional[FusedMoEPacker]:
    """Return ``pack(w13, w2) -> fn(hidden, router_logits, correction_bias=None)`` for a
    Mixture-of-Experts layer of ``spec`` (:class:`MoESpec`: routing, shape, dtype): ``pack``
    is called once per layer at load with its stacked expert weights, ``fn`` once per layer
    and step, routing every token and applying its experts in one call
    (:class:`~octavo.platform.types.FusedMoEFn`; the oracle is
    ``octavo.ops.reference.fused_moe``, a loop over the step's experts).

    Optional: without it MoE layers run the reference. Stops at the first non-None result.
    Called once per distinct ``spec`` at start-up.
    """


@hookspec(firstresult=True)
def octavo_rotary_embedding(platform: PlatformInfo) -> Optional[RotaryFn]:
    """Return ``fn((cos, sin), query, key, head_dim) -> (query, key)``: the rotary embedding of
    the step's query and key as one kernel (it may rotate them in place).

    Optional: without it the model composes ``octavo.ops.reference.rotary_embedding``. Stops at
    the first non-None result. Called once at start-up.
    """


@hookspec(firstresult=True)
def octavo_linear_packer(platform: PlatformInfo, dtype: torch.dtype) -> Optional[LinearPacker]:
    """Return how this platform multiplies the unquantised linear layers of ``dtype``: a
    ``pack(weight)`` called once per weight at load, returning ``fn(x) -> x @ weight.T`` (for
    example over a copy of the weight reordered for the platform's GEMM). None: ``F.linear``.

    Stops at the first non-None result. Called once at start-up.
    """


@hookspec(firstresult=True)
def octavo_quantized_linear_packer(
    platform: PlatformInfo, quant_type: str
) -> Optional[QuantizedLinearPacker]:
    """Return how this platform multiplies linear layers whose weights are kept quantized in
    ``quant_type``'s rows (``octavo.quantization.quant_types``: a GGUF type such as ``"Q8_0"``,
    ``"Q4_0"``, ``"Q4_K"``, or ``"int8"`` for ``--quantization int8``): a ``pack(raw,
    in_features)`` called once per weight at load, returning ``fn(x) -> x @ W.T``. None: no
    kernel for that type here (a GGUF file's tensors of it are dequantized at load, and
    ``--quantization int8`` is refused).

    Optional. Stops at the first non-None result. Called once per type at start-up.
    """


@hookspec(firstresult=True)
def octavo_decoder_stack(platform: PlatformInfo, layers: Any, norm: Any) -> Optional[Any]:
    """Return ``fn(hidden [T, hidden], cos_sin, attn_metadata) -> hidden``: the Llama decoder
    ``layers`` (an ``nn.ModuleList`` of ``octavo.models.llama.LlamaDecoderLayer``) and then
    ``norm`` (an ``RMSNorm`` taking the last layer's residual) in one call, with the numbers the
    modules give (for example their kernels chained in compiled code). None where it does not
    apply to these layers: the model runs them as modules.

    Optional. Stops at the first non-None result. Called once per model after its linears are
    packed, for the target model and a draft head alike.
    """


@hookspec(firstresult=True)
def octavo_draft_head(platform: PlatformInfo, head: Any) -> Optional[Any]:
    """Return ``fn(input_ids [T], hidden_states, positions [T], attn_metadata, masked=None) ->
    hidden [T, hidden]``: an EAGLE-family draft head's forward in one call (``head`` an
    ``octavo.spec_decode.eagle_head.EagleHead`` attached to its target: the target's embedding
    of each token beside its hidden state, ``fc``, the rotary tables, the decoder layer and the
    norm), with the numbers the head's modules give. With ``masked`` (bool ``[T]``, a P-EAGLE
    head's masked slots) the masked tokens read the head's ``mask_embedding`` and
    ``mask_hidden`` and ``hidden_states`` holds the other tokens' rows only, in order. The
    result may also have ``compute_logits(hidden_states [R, hidden]) -> [R, vocab]`` (the head's
    logits: the target's LM head, or a copy of it kept as the head's weights are),
    ``greedy_drafts(hidden_states) -> int64 [R]`` (each row's argmax of those logits: the greedy
    drafts), ``greedy_head_drafts(hidden_states, rows, first, num_verified, steps, parallel,
    token_ids, block_table, block_size, mlp_drafts=0) -> (drafts int64 [R, steps + mlp_drafts],
    hidden [R, hidden])`` (a greedy step's pass and drafts: the pass over each row's verified
    positions ``first .. first + num_verified - 1``, each with the token after it in
    ``token_ids[rows]`` and its row of ``hidden_states``, its KV written to the slots of
    ``block_table[rows]`` (the batch's int32 tables and int64 ``[R]`` vectors, on the host);
    with ``parallel`` a P-EAGLE head's ``steps - 1`` masked slots after them and every draft
    from the pass's outputs, else the first draft from the last output and ``steps - 1`` serial
    head steps, then, for a Gumiho head, ``mlp_drafts`` from its MLP heads as
    ``draft_in_parallel`` makes them; ``hidden`` the predictions the last serial or parallel
    drafts were scored from) and, for a Gumiho head (``octavo.spec_decode.gumiho.GumihoHead``),
    ``draft_in_parallel(last_drafts, hidden_states, count) -> [count, R, hidden]``, the head's
    own method, each in one call. Its numbers are the modules', or a drafter's own (for example
    over weights kept in a narrower dtype): drafts never reach the output, but every path of
    one head must draft alike. None where it does not apply to this head: it runs its modules.

    Optional. Stops at the first non-None result. Called once per head after it is attached to
    its target (its linears packed and its decoder stack, if any, attached).
    """


@hookspec(firstresult=True)
def octavo_communicator(platform: PlatformInfo, group: Any) -> Optional[Communicator]:
    """Return collective operations (all-reduce, all-gather, send, recv) for a process group.

    Stops at the first non-None result. Called once per group at start-up.
    """


@hookspec(firstresult=True)
def octavo_graph_runner(platform: PlatformInfo, model: Any, config: Any) -> Optional[Any]:
    """Return the forward the model runner calls for ``model``: compiled, captured, or the model
    under the platform's per-step settings (the cpu platform's thread count). It is called as
    ``forward(input_ids, positions, attn_metadata)`` and returns the hidden states, as the model
    does; the runner then calls ``model.compute_logits`` itself. None runs the model as it is.
    ``config.enforce_eager`` False (``--no-enforce-eager``) asks for a compiled forward: one has
    a true ``compiled`` attribute, and the runner warms it up at start-up; a platform that cannot
    compile returns an eager one, and the runner says the model runs eagerly.

    Stops at the first non-None result. Called once after the model is loaded and packed.
    """


@hookspec(firstresult=True)
def octavo_model_runner(platform: PlatformInfo, config: Any) -> Optional[Any]:
    """Return the platform's own model runner (e.g. a JAX runner on TPU), as a factory the
    engine calls ``factory(model_config, platform, config)``: the model's ``ModelConfig``, the
    chosen :class:`~octavo.platform.Platform` and ``config``, the engine's ``RunnerConfig``
    (block size, step limits, speculation).

    The runner it makes is an :class:`~octavo.platform.types.EngineRunner`: the engine core
    hands it each ``SchedulerOutput`` and gets back a ``ModelRunnerOutput`` (the tokens sampled
    per request); nothing else crosses. Building on
    :class:`octavo.model_executor.batch_runner.BatchRunner` gives it the request states, the
    persistent batch and the step's flat inputs that the core's runner uses. It raises
    :class:`octavo.errors.ConfigError` for what it cannot run (at start-up, before any
    request).

    None means the core's torch ``ModelRunner``. Stops at the first non-None result. Called
    once at start-up.
    """


# --- extension points ------------------------------------------------------------------------


@hookspec
def octavo_model_architectures() -> Optional[dict[str, type]]:
    """Return ``{"LlamaForCausalLM": cls, ...}``: model classes by HuggingFace architecture name.

    Collects every result; a name offered twice is an error. Called once at model load.
    """


@hookspec
def octavo_kv_connectors() -> Optional[dict[str, type]]:
    """Return ``{"name": cls}``: KV connectors for disaggregated prefill/decode.

    Collects every result. Called once at start-up when a connector is configured.
    """


@hookspec
def octavo_tool_parsers() -> Optional[dict[str, type]]:
    """Return ``{"hermes": cls}``: tool-call parsers (:class:`octavo.tool_parsers.ToolParser`,
    built with no arguments) by the name ``--tool-call-parser`` takes.

    Collects every result; a name offered twice is an error. Called once at server start-up.
    """
