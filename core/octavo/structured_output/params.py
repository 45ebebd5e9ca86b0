"""What a request's output must match: vLLM's ``StructuredOutputsParams`` (one of a JSON schema,
any JSON object, a regex, a choice of strings, an EBNF grammar, a structural tag)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional, Union

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint. ``json``: a JSON schema (dict or its JSON text); ``json_object``:
    any JSON object; ``regex``; ``choice``: one of these strings; ``grammar``: EBNF (xgrammar's
    GBNF dialect); ``structural_tag``: xgrammar's structural-tag format (dict or JSON text).
    ``any_whitespace``: JSON may hold free whitespace between tokens (None: the engine's
    ``--structured-outputs-config``, which leaves it off by default: a small model given it
    loops on newlines)."""

    json: Union[None, str, dict[str, Any]] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None
    structural_tag: Union[None, str, dict[str, Any]] = None
    any_whitespace: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must hold strings only")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    message = f"structured_outputs.{name} is not valid JSON: {exc}"
                    raise ValueError(message) from None
                object.__setattr__(self, name, value)
            if value is not None and not isinstance(value, (dict, bool)):
                raise ValueError(f"structured_outputs.{name} must be a JSON object")
        if not isinstance(self.json_object, bool) or self.any_whitespace not in (None, True, False):
            raise ValueError("structured_outputs.json_object and .any_whitespace are true or false")
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(KINDS)}; got {', '.join(given) or 'none'}"
            )

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> tuple:
        """A hashable key of the constraint (grammars are cached by it)."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        return (self.kind, value, self.any_whitespace)
