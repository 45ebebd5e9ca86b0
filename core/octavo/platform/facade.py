"""The chosen platform with its hooks resolved into plain callables.

Every ``pm.hook`` call happens here, at start-up; what the model and runner keep are the
returned kernels, so the per-step path never goes through pluggy.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import pluggy
import torch

from octavo.errors import KernelNotAvailableError, PlatformError
from octavo.ops import reference
from octavo.platform.manager import create_plugin_manager
from octavo.platform.selection import (
    Selection,
    choose_platform,
    detect_platforms,
    unregister_losers,
)
from octavo.platform.types import (
    AttentionBackend,
    AttentionSpec,
    BitmaskFn,
    Capabilities,
    Communicator,
    EngineRunner,
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


class Platform:
    """One selected platform: its info, capabilities and resolved kernels."""

    def __init__(self, pm: pluggy.PluginManager, selection: Selection):
        self.pm = pm
        self.selection = selection
        self.info: PlatformInfo = selection.chosen.info
        caps = pm.hook.octavo_platform_capabilities(platform=self.info)
        if caps is None:
            raise PlatformError(f"platform {self.name!r} reported no capabilities")
        self.capabilities: Capabilities = caps

    @classmethod
    def select(
        cls, device: Optional[str] = None, pm: Optional[pluggy.PluginManager] = None
    ) -> "Platform":
        """Detect, choose (``device`` or ``$OCTAVO_PLATFORM`` wins), drop the losers, resolve."""
        pm = pm if pm is not None else create_plugin_manager()
        selection = choose_platform(detect_platforms(pm), device)
        unregister_losers(pm, selection)
        return cls(pm, selection)

    @property
    def name(self) -> str:
        return self.info.name

    def __repr__(self) -> str:
        return f"Platform({self.name!r}, device_type={self.info.device_type!r})"

    def others_available(self) -> list[str]:
        """The other platforms detection found available here, by name."""
        return sorted(
            d.info.name
            for d in self.selection.detections
            if d.info.available and d.info.name != self.name
        )

    def choose_another(self) -> str:
        """What to do instead, for messages: the ``--device`` choices detection found here."""
        others = self.others_available()
        if not others:
            return "no other platform is available here (`octavo env` says why each is not)"
        return f"choose another platform with --device ({', '.join(others)} available here)"

    def _require(self, hook_name: str, result: Any, what: str) -> Any:
        if result is None:
            raise KernelNotAvailableError(
                f"platform {self.name!r} provides no {what} (hook {hook_name}); "
                f"{self.choose_another()}, or install a plugin that provides it"
            )
        return result

    # --- set-up ------------------------------------------------------------------------------

    def device_init(self, local_rank: int = 0) -> torch.device:
        """Initialise the device runtime and return the device this process computes on."""
        result = self.pm.hook.octavo_device_init(platform=self.info, local_rank=local_rank)
        return self._require("octavo_device_init", result, "device")

    def memory_info(self, device: torch.device) -> MemoryInfo:
        result = self.pm.hook.octavo_memory_info(platform=self.info, device=device)
        return self._require("octavo_memory_info", result, "memory info")

    def configure(self, config: Any) -> dict[str, Any]:
        """Merged config overrides from every plugin (a plugin may raise ConfigError)."""
        overrides: dict[str, Any] = {}
        for result in self.pm.hook.octavo_configure(platform=self.info, config=config):
            overrides.update(result or {})
        return overrides

    # --- kernels (cached: a second request for the same shape returns the same callable) ---

    @functools.lru_cache(maxsize=None)
    def attention_backend(self, spec: AttentionSpec) -> AttentionBackend:
        result = self.pm.hook.octavo_attention_backend(platform=self.info, spec=spec)
        return self._require("octavo_attention_backend", result, "attention backend")

    @functools.lru_cache(maxsize=None)
    def mla_attention_backend(self, spec: MLASpec) -> MLAAttentionBackend:
        """The platform's multi-head latent attention backend, or the reference's."""
        result = self.pm.hook.octavo_mla_attention_backend(platform=self.info, spec=spec)
        return result if result is not None else reference.ReferenceMLABackend(spec)

    @functools.lru_cache(maxsize=None)
    def rms_norm(self, hidden_size: int, eps: float, dtype: torch.dtype) -> RMSNormFn:
        result = self.pm.hook.octavo_rms_norm(
            platform=self.info, hidden_size=hidden_size, eps=eps, dtype=dtype
        )
        return self._require("octavo_rms_norm", result, "RMSNorm kernel")

    @functools.lru_cache(maxsize=None)
    def sampler(self, vocab_size: int) -> SamplerFn:
        result = self.pm.hook.octavo_sampler(platform=self.info, vocab_size=vocab_size)
        return self._require("octavo_sampler", result, "sampler")

    @functools.lru_cache(maxsize=None)
    def apply_token_bitmask(self) -> BitmaskFn:
        result = self.pm.hook.octavo_apply_token_bitmask(platform=self.info)
        return self._require("octavo_apply_token_bitmask", result, "token-bitmask kernel")

    @functools.lru_cache(maxsize=None)
    def rejection_sampler(self) -> RejectionSamplerFn:
        result = self.pm.hook.octavo_rejection_sampler(platform=self.info)
        return self._require("octavo_rejection_sampler", result, "rejection sampler")

    @functools.lru_cache(maxsize=None)
    def scaled_mm(self) -> ScaledMMFn:
        result = self.pm.hook.octavo_scaled_mm(platform=self.info)
        return self._require("octavo_scaled_mm", result, "FP8 scaled matmul")

    @functools.lru_cache(maxsize=None)
    def silu_and_mul(self) -> SiluAndMulFn:
        """The platform's fused ``silu(gate) * up``, or the reference's composition."""
        result = self.pm.hook.octavo_silu_and_mul(platform=self.info)
        return result if result is not None else reference.silu_and_mul

    @functools.lru_cache(maxsize=None)
    def rotary_embedding(self) -> RotaryFn:
        """The platform's rotary embedding of query and key, or the reference's composition."""
        result = self.pm.hook.octavo_rotary_embedding(platform=self.info)
        return result if result is not None else reference.rotary_embedding

    @functools.lru_cache(maxsize=None)
    def lora_kernels(self, dtype: torch.dtype) -> LoRAKernels:
        """The platform's batched LoRA products for ``dtype``, or the reference's."""
        result = self.pm.hook.octavo_lora_kernels(platform=self.info, dtype=dtype)
        return result if result is not None else reference.LORA_KERNELS

    @functools.lru_cache(maxsize=None)
    def fused_moe(self, spec: MoESpec) -> FusedMoEPacker:
        """The platform's packer of Mixture-of-Experts layers of ``spec``, or the reference's
        (a loop over the step's experts)."""
        result = self.pm.hook.octavo_fused_moe(platform=self.info, spec=spec)
        return result if result is not None else functools.partial(reference.pack_fused_moe, spec)

    def linear_packer(self, dtype: torch.dtype) -> Optional[LinearPacker]:
        """The platform's own matmul for unquantised linear layers of ``dtype``, or None."""
        return self.pm.hook.octavo_linear_packer(platform=self.info, dtype=dtype)

    @functools.lru_cache(maxsize=None)
    def quantized_linear_packer(self, quant_type: str) -> Optional[QuantizedLinearPacker]:
        """The platform's matmul over weights kept in ``quant_type``'s rows, or None (the
        weights are dequantized at load)."""
        return self.pm.hook.octavo_quantized_linear_packer(
            platform=self.info, quant_type=quant_type
        )

    def decoder_stack(self, layers: torch.nn.Module, norm: torch.nn.Module) -> Optional[Any]:
        """The platform's one-call run of Llama decoder ``layers`` and the final ``norm``
        (``octavo_decoder_stack``), or None: the model runs its modules."""
        return self.pm.hook.octavo_decoder_stack(platform=self.info, layers=layers, norm=norm)

    def draft_head(self, head: torch.nn.Module) -> Optional[Any]:
        """The platform's one-call forward of an EAGLE-family draft head
        (``octavo_draft_head``), or None: the head runs its modules."""
        return self.pm.hook.octavo_draft_head(platform=self.info, head=head)

    def graph_runner(self, model: torch.nn.Module, config: Any) -> Any:
        """The forward the runner calls for ``model``: the platform's own, or the model."""
        result = self.pm.hook.octavo_graph_runner(platform=self.info, model=model, config=config)
        return result if result is not None else model

    def model_runner(self, runner_config: Any) -> Optional[Callable[..., EngineRunner]]:
        """The platform's own model runner (``octavo_model_runner``) as a factory called
        ``factory(model_config, platform, runner_config)``, or None for the core's torch
        runner."""
        return self.pm.hook.octavo_model_runner(platform=self.info, config=runner_config)

    def communicator(self, group: Any) -> Communicator:
        """Collectives over the torch.distributed ``group`` (of ``capabilities.dist_backend``)."""
        return self._require(
            "octavo_communicator",
            self.pm.hook.octavo_communicator(platform=self.info, group=group),
            "a communicator for tensor parallelism",
        )

    def model_architectures(self) -> dict[str, type]:
        """Architecture name -> model class from every plugin; a name offered twice is an error."""
        return _merged(self.pm.hook.octavo_model_architectures(), "architecture")

    def tool_parsers(self) -> dict[str, type]:
        """Tool-parser name -> class from every plugin; a name offered twice is an error."""
        return _merged(self.pm.hook.octavo_tool_parsers(), "tool parser")


def _merged(results: list, what: str) -> dict[str, type]:
    """One mapping from a collecting hook's ``{name: class}`` results; a name two plugins offer
    (with different classes) is a PlatformError."""
    merged: dict[str, type] = {}
    for result in results:
        for name, cls in (result or {}).items():
            if name in merged and merged[name] is not cls:
                raise PlatformError(
                    f"{what} {name!r} is provided by two plugins "
                    f"({merged[name].__module__} and {cls.__module__}); uninstall one"
                )
            merged[name] = cls
    return merged
