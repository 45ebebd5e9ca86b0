"""Request defaults from a model's ``generation_config.json``, as vLLM's ``--generation-config``.

With ``auto`` (the default, as in vLLM) the model creator's recommended ``temperature``,
``top_k``, ``top_p``, ``min_p`` and ``repetition_penalty`` become the values of requests that leave
them unset, and ``max_new_tokens`` caps every request's output length. ``vllm`` ignores the file
(the library defaults apply); any other value names a folder whose generation_config.json is read
instead. Fields of ``override_generation_config`` win over the file's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from octavo.errors import ConfigError
from octavo.model_executor.model_config import read_json
from octavo.sampling_params import SamplingParams

GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json key -> SamplingParams field, for the keys vLLM takes defaults from."""


def load_sampling_defaults(
    generation_config: str,
    model_generation_config: Mapping[str, Any],
    override: Optional[Mapping[str, Any]] = None,
) -> dict[str, Any]:
    """The SamplingParams fields a request gets when it leaves them unset (empty: none)."""
    if generation_config == "vllm":
        source: dict[str, Any] = {}
    elif generation_config == "auto":
        source = dict(model_generation_config)
    else:
        path = Path(generation_config) / "generation_config.json"
        if not path.is_file():
            raise ConfigError(
                f"generation_config {generation_config!r} has no generation_config.json; "
                "give a folder that has one, 'auto' (the model's own) or 'vllm' (ignore it)"
            )
        source = read_json(path)
    source.update(override or {})
    defaults = {
        ours: source[theirs]
        for theirs, ours in GENERATION_CONFIG_FIELDS.items()
        if source.get(theirs) is not None
    }
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ConfigError(
            f"the generation config's sampling defaults {defaults} are invalid: {exc}; "
            "fix them with --override-generation-config or ignore the file with "
            "--generation-config vllm"
        ) from exc
    return defaults


def cap_max_tokens(max_tokens: Optional[int], defaults: Mapping[str, Any]) -> Optional[int]:
    """A request's output limit under the generation config's ``max_new_tokens`` cap, if any."""
    cap = defaults.get("max_tokens")
    if cap is None:
        return max_tokens
    return cap if max_tokens is None else min(max_tokens, cap)
