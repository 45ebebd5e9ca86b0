"""The model runner's side of LoRA: which adapter sits in which of the ``max_loras`` slots, the
adapters kept loaded in host memory beyond them (``max_cpu_loras``, least recently used
evicted), and each step's token -> slot mapping.

The scheduler never runs more than ``max_loras`` adapters in one step, so a step's adapters
always fit: one not in a slot takes a free slot or that of an adapter the step does not use.
"""

from __future__ import annotations

import collections
import logging
from typing import Optional

import numpy as np
import torch
from torch import nn

from octavo.errors import ConfigError, RequestError
from octavo.lora.adapter import LoRAAdapter, load_adapter, module_shapes
from octavo.lora.config import LoRAConfig
from octavo.lora.layers import attach_lora
from octavo.lora.mapping import build_lora_mapping
from octavo.lora.request import LoRARequest
from octavo.platform.types import LoRAKernels

logger = logging.getLogger(__name__)


class LoRASlots:
    """Adapters in slots and in host memory, for one model (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        model_config,
        config: LoRAConfig,
        kernels: LoRAKernels,
        device: torch.device,
    ):
        self.model_config, self.config, self.device = model_config, config, device
        self.step, self.parts = attach_lora(
            model,
            module_shapes(model_config),
            config.max_loras,
            config.max_lora_rank,
            kernels,
            model_config.dtype,
        )
        self.requests: dict[int, LoRARequest] = {}  # every adapter a request has named
        self.loaded: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        self.slot_of: dict[int, int] = {}  # lora_int_id -> slot
        self.free_slots = list(range(config.max_loras))

    def num_bytes(self) -> int:
        """Bytes of the slots' stacked weights (counted before the KV cache is sized)."""
        return sum(
            p.a.numel() * p.a.element_size() + p.b.nbytes
            for layer in self.parts
            for p in layer.values()
        )

    def note(self, lora_request: LoRARequest) -> None:
        """Remember where a request's adapter is, for when it needs a slot."""
        known = self.requests.get(lora_request.lora_int_id)
        if known is not None and known.lora_path != lora_request.lora_path:
            self.forget(lora_request.lora_int_id)  # the id now names other weights
        self.requests[lora_request.lora_int_id] = lora_request

    def forget(self, lora_int_id: int) -> None:
        """Drop an adapter from its slot and from host memory (it was unloaded)."""
        self.loaded.pop(lora_int_id, None)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    # --- the step ----------------------------------------------------------------------------

    def prepare_step(
        self, row_lora_ids: np.ndarray, num_scheduled: np.ndarray, req_ids: list[str]
    ) -> None:
        """Put the step's adapters in slots and set the step's mapping (None when no row has
        an adapter); an adapter that cannot be loaded fails its requests (RequestError)."""
        used = row_lora_ids > 0
        if not used.any():
            self.step.mapping = None
            return
        step_ids = [int(i) for i in np.unique(row_lora_ids[used])]
        failed = {}
        for lora_id in step_ids:
            try:
                self._activate(lora_id, step_ids)
            except Exception as exc:  # noqa: BLE001 - whatever it is, it is this adapter's
                message = f"LoRA adapter {self.requests[lora_id].lora_name!r}: {exc}"
                failed.update((r, message) for r, i in zip(req_ids, row_lora_ids) if i == lora_id)
        if failed:
            self.step.mapping = None
            raise RequestError(failed)
        row_slots = np.full(len(row_lora_ids), -1, dtype=np.int64)
        for lora_id in step_ids:
            row_slots[row_lora_ids == lora_id] = self.slot_of[lora_id]
        self.step.mapping = build_lora_mapping(np.repeat(row_slots, num_scheduled), self.device)

    def _activate(self, lora_id: int, step_ids: list[int]) -> None:
        if lora_id in self.slot_of:
            return
        adapter = self._host_adapter(lora_id)
        if not self.free_slots:  # the scheduler keeps a step's adapters within the slots
            idle = next(i for i in self.slot_of if i not in step_ids)
            self.free_slots.append(self.slot_of.pop(idle))
        slot = self.free_slots.pop(0)
        self._write_slot(slot, adapter)
        self.slot_of[lora_id] = slot

    def _host_adapter(self, lora_id: int) -> LoRAAdapter:
        adapter = self.loaded.get(lora_id)
        if adapter is not None:
            self.loaded.move_to_end(lora_id)
            return adapter
        request = self.requests[lora_id]
        adapter = load_adapter(request.lora_path, self.model_config, self.config.max_lora_rank)
        self.loaded[lora_id] = adapter
        while len(self.loaded) > self.config.max_cpu_loras:
            evicted, _ = self.loaded.popitem(last=False)
            logger.info("LoRA: adapter id %d evicted from host memory (LRU)", evicted)
        return adapter

    @torch.inference_mode()
    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        rank = adapter.rank
        for layer_index, parts in enumerate(self.parts):
            for module, part in parts.items():
                part.a[slot].zero_()
                part.b[slot].zero_()
                weights = adapter.weights.get((layer_index, module))
                if weights is None:
                    continue
                a, b = weights
                part.a[slot, :rank].copy_(a)
                part.b[slot, :, :rank].copy_(b)


def lora_slots_for(runner, model: nn.Module) -> Optional[LoRASlots]:
    """The runner's LoRA slots when ``--enable-lora`` is on (None otherwise)."""
    config = runner.config.lora_config
    if config is None:
        return None
    refuse_unadaptable(model, runner.model_config.architecture)
    kernels = runner.platform.lora_kernels(runner.model_config.dtype)
    return LoRASlots(model, runner.model_config, config, kernels, runner.device)


def refuse_unadaptable(model: nn.Module, architecture: str) -> None:
    """``--enable-lora`` covers the dense Llama family's projections; Mixture-of-Experts
    experts (stacked, not linear layers) and latent attention (its up-projection read as a
    weight) would silently ignore an adapter's deltas, so those models are refused."""
    from octavo.models.layers.fused_moe import FusedExperts
    from octavo.models.layers.mla import MLAAttention

    kinds = {"Mixture-of-Experts": FusedExperts, "multi-head latent attention": MLAAttention}
    for what, cls in kinds.items():
        if any(isinstance(m, cls) for m in model.modules()):
            raise ConfigError(
                f"--enable-lora: LoRA adapters on {architecture} ({what}) are not supported "
                "yet; serve it without --enable-lora, or merge the adapter into the weights"
            )
