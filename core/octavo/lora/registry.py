"""The engine's side of LoRA: the adapters it serves by name (``--lora-modules`` and those
loaded at run time), each checked against the base model once, before a request may use it.
The model runner loads the weights itself when a request first needs them (``.slots``)."""

from __future__ import annotations

import itertools
from typing import Optional

from octavo.errors import ConfigError
from octavo.lora.adapter import check_adapter
from octavo.lora.config import LoRAConfig
from octavo.lora.request import LoRARequest


class LoRARegistry:
    """Adapters by name; ``config`` None means ``--enable-lora`` is off (every use refused)."""

    def __init__(self, model_config, config: Optional[LoRAConfig]):
        self.model_config, self.config = model_config, config
        self.adapters: dict[str, LoRARequest] = {}
        self._checked: dict[int, str] = {}  # lora_int_id -> the path checked for it
        self._ids = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def _require_enabled(self) -> None:
        if self.config is None:
            raise ConfigError(
                "this engine serves no LoRA adapters: start it with --enable-lora (and "
                "--max-lora-rank at least the adapters' rank)"
            )

    def check(self, lora_request: Optional[LoRARequest]) -> None:
        """Refuse a request's adapter that cannot run here (ConfigError saying why)."""
        if lora_request is None:
            return
        self._require_enabled()
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be an octavo.lora.LoRARequest; got {type(lora_request)!r}"
            )
        checked = self._checked.get(lora_request.lora_int_id)
        if checked is not None and checked != lora_request.lora_path:
            raise ConfigError(
                f"lora_int_id {lora_request.lora_int_id} already names the adapter at "
                f"{checked!r}, not {lora_request.lora_path!r}: give each adapter its own id"
            )
        if checked is None:
            check_adapter(lora_request.lora_path, self.model_config, self.config.max_lora_rank)
            self._checked[lora_request.lora_int_id] = lora_request.lora_path

    def add(self, name: str, path: str, base_model_name: Optional[str] = None) -> LoRARequest:
        """Serve the adapter at ``path`` as ``name`` (checked now); a name already served is
        refused (unload it first)."""
        self._require_enabled()
        if name in self.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
        lora_int_id = next(self._ids)
        while lora_int_id in self._checked:  # ids offline callers chose themselves
            lora_int_id = next(self._ids)
        request = LoRARequest(name, lora_int_id, path, base_model_name)
        self.check(request)
        self.adapters[name] = request
        return request

    def remove(self, name: str) -> LoRARequest:
        """Stop serving ``name`` (a KeyError when it is not served)."""
        self._require_enabled()
        request = self.adapters.pop(name)
        self._checked.pop(request.lora_int_id, None)
        return request

    def get(self, name: str) -> Optional[LoRARequest]:
        return self.adapters.get(name)
