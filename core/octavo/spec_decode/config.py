"""``speculative_config``: vLLM's dict (``LLM(..., speculative_config={...})``, ``octavo serve
--speculative-config JSON``), checked once into a frozen :class:`SpeculativeConfig`.

What needs the target model (a draft model's vocabulary and tokenizer) is checked by
:func:`check_draft_model` when the engine has read the target's config.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from octavo.errors import ConfigError

METHODS = ("ngram", "draft_model", "eagle", "gumiho", "mtp")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed and how many per step.

    ``num_speculative_tokens`` (K) is the most drafts a request is scheduled each step.
    ``ngram`` proposes the continuation of the longest earlier match of the request's last
    ``prompt_lookup_min`` .. ``prompt_lookup_max`` tokens (vLLM's defaults: 5 and 5; one bound
    given alone stands for both); ``draft_model`` runs ``model``, a
    smaller model of the same tokenizer; ``eagle`` runs ``model``, an EAGLE head trained for the
    target (``octavo.spec_decode.eagle``); ``gumiho`` runs ``model``, a Gumiho head (the first
    two drafts serially, the rest from parallel MLP heads: ``octavo.spec_decode.gumiho``);
    ``mtp`` runs the target's own multi-token-prediction layer (``octavo.spec_decode.mtp``;
    ``model``, if given, is the target's folder).
    ``parallel_drafting`` (eagle only, vLLM's P-EAGLE): the head drafts all K tokens in one
    pass (``octavo.spec_decode.p_eagle``; a head trained for it).
    ``disable_by_batch_size``: no drafts are proposed in a
    step whose batch holds at least this many requests (None: always propose). ``adaptive``
    (octavo's): schedule a request's drafts only while they are expected to raise the step's
    tokens per second, from its measured acceptance and step times
    (``octavo.spec_decode.policy``); False schedules every draft.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: Optional[str] = None
    disable_by_batch_size: Optional[int] = None
    adaptive: bool = True
    parallel_drafting: bool = False

    @classmethod
    def from_dict(cls, value: Union[None, str, Mapping[str, Any], "SpeculativeConfig"]):
        """A SpeculativeConfig from vLLM's dict (or its JSON text); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ConfigError(f"speculative_config is not valid JSON ({exc})") from None
        if not isinstance(value, Mapping):
            raise ConfigError(
                "speculative_config must be a dict like "
                '{"method": "ngram", "num_speculative_tokens": 4}; '
                f"got {type(value).__name__}"
            )
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ConfigError(
                f"speculative_config.{unknown[0]} is not a known field; known: {', '.join(fields)}"
            )
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ConfigError(f"speculative_config.{name} is required")
        values = dict(value)
        if values["method"] == "ngram":
            # vLLM's rule: one bound given stands for both when the other is missing.
            if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
                values["prompt_lookup_min"] = values["prompt_lookup_max"]
            if "prompt_lookup_min" in values and "prompt_lookup_max" not in values:
                values["prompt_lookup_max"] = values["prompt_lookup_min"]
        return cls(**values)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(
                f"speculative_config.method must be one of {', '.join(METHODS)}; "
                f"got {self.method!r}"
            )
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        if not isinstance(self.adaptive, bool):
            raise ConfigError(
                f"speculative_config.adaptive must be true or false; got {self.adaptive!r}"
            )
        if not isinstance(self.parallel_drafting, bool):
            raise ConfigError(
                "speculative_config.parallel_drafting must be true or false; "
                f"got {self.parallel_drafting!r}"
            )
        if self.parallel_drafting and self.method != "eagle":
            raise ConfigError(
                "speculative_config.parallel_drafting is for method 'eagle' (P-EAGLE); "
                f"method {self.method!r} drafts otherwise"
            )
        if self.disable_by_batch_size is not None:
            _positive("disable_by_batch_size", self.disable_by_batch_size)
        if self.method == "ngram":
            _positive("prompt_lookup_min", self.prompt_lookup_min)
            _positive("prompt_lookup_max", self.prompt_lookup_max)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ConfigError(
                    f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                    f"prompt_lookup_max ({self.prompt_lookup_max})"
                )
            if self.model is not None:
                raise ConfigError(
                    "speculative_config.model is for method 'draft_model'; "
                    "the ngram method uses no model"
                )
        elif self.method == "mtp":
            if (
                self.model is not None
                and not (Path(self.model).expanduser() / "config.json").is_file()
            ):
                raise ConfigError(
                    f"speculative_config.model {self.model!r} is not a model folder; the mtp "
                    "method needs none (it uses the target's own MTP layers)"
                )
        else:
            what = _MODEL_OF[self.method]
            if not self.model:
                raise ConfigError(
                    f"speculative_config.model is required for method {self.method!r}: "
                    f"the local folder of {what}"
                )
            path = Path(self.model).expanduser()
            if not (path / "config.json").is_file():
                raise ConfigError(
                    f"speculative_config.model {self.model!r} is not a model folder "
                    f"(no config.json there); give the local folder of {what}"
                )


_MODEL_OF = {
    "draft_model": "a smaller model with the target's tokenizer",
    "eagle": "an EAGLE head made for the target (its format: octavo.spec_decode.eagle_head)",
    "gumiho": "a Gumiho head made for the target (its format: octavo.spec_decode.gumiho)",
}


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"speculative_config.{name} must be an integer >= 1; got {value!r}")


def check_draft_model(
    draft_vocab_size: int,
    target_vocab_size: int,
    draft_tokenizer_files: Mapping[str, bytes],
    target_tokenizer_files: Mapping[str, bytes],
) -> None:
    """A draft model must score the target's vocabulary with the target's tokenizer: the same
    vocabulary size and the same tokenizer files (their bytes, where both folders hold one)."""
    if draft_vocab_size != target_vocab_size:
        raise ConfigError(
            f"speculative_config.model has a vocabulary of {draft_vocab_size} tokens but the "
            f"target's has {target_vocab_size}; the draft model must share the target's tokenizer"
        )
    for name in sorted(set(draft_tokenizer_files) & set(target_tokenizer_files)):
        if draft_tokenizer_files[name] != target_tokenizer_files[name]:
            raise ConfigError(
                f"speculative_config.model's {name} differs from the target model's; "
                "the draft model must share the target's tokenizer"
            )
    if not set(draft_tokenizer_files) & set(target_tokenizer_files):
        raise ConfigError(
            "speculative_config.model has none of the target's tokenizer files "
            f"({', '.join(sorted(target_tokenizer_files)) or 'none found'}); "
            "the draft model must share the target's tokenizer"
        )
