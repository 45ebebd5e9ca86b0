"""xgrammar for one model: its tokenizer's vocabulary at the model's (padded) vocabulary size,
one compiler, compiled grammars cached by constraint, one matcher per request."""

from __future__ import annotations

import json
import threading
from typing import Any, Sequence

from octavo.model_executor.tokenizer import hf_tokenizer
from octavo.structured_output.params import StructuredOutputsParams

BATCH_FILL_MIN = 8  # rows from which one batched fill beats filling them one by one

# The character class xgrammar gives a bounded-length JSON string, and what it should be.
_BOUNDED_STRING_CHARACTER = r"[^\"\\\r\n]"
_JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\]"


def json_grammar(schema: dict, any_whitespace: bool) -> str:
    """xgrammar's EBNF grammar of JSON matching ``schema``, with its bounded-length string
    characters (for ``minLength``/``maxLength``) kept to what JSON allows unescaped: xgrammar
    0.2.9 lets them be control characters, which no JSON parser accepts. Tool calls' arguments
    use it too (as a structural tag's ``grammar`` content), so they follow the same rules."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=any_whitespace)
    return str(grammar).replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER)


class GrammarBackend:
    """Compiles a request's constraint into an xgrammar ``CompiledGrammar`` (cached) and makes
    matchers from it. A constraint xgrammar cannot compile is a ValueError naming the field."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int] = (),
        any_whitespace: bool = False,
    ):
        """``tokenizer``: what ``load_tokenizer`` returned (xgrammar reads its transformers
        tokenizer). ``any_whitespace``: whether JSON may hold free whitespace when a request does
        not say (``--structured-outputs-config``)."""
        import xgrammar

        self.xgrammar = xgrammar
        self.any_whitespace = any_whitespace
        self.vocab_size = vocab_size
        self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer(tokenizer),
            vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids) or None,
        )
        self.compiler = xgrammar.GrammarCompiler(self.tokenizer_info, max_threads=2)
        self._compiled: dict[tuple, Any] = {}
        self._batch_matcher = None
        self._lock = threading.Lock()  # the server compiles off the engine's thread

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params`` (from the cache when it was compiled before)."""
        key = (*params.key(), self._any_whitespace(params))
        with self._lock:
            compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        try:
            compiled = self._compile(params)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError, ...
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(
                f"structured_outputs.{params.kind} cannot be compiled to a grammar: {detail}"
            ) from None
        with self._lock:
            self._compiled[key] = compiled
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler, kind = self.compiler, params.kind
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else {"type": "object"}
            if not isinstance(schema, dict):
                schema = {}  # ``true``: any JSON value
            grammar = json_grammar(schema, self._any_whitespace(params))
            return compiler.compile_grammar(grammar)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":  # EBNF string literals take JSON's escapes
            return compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(choice) for choice in params.choice)
            )
        if kind == "grammar":
            return compiler.compile_grammar(params.grammar)
        return compiler.compile_structural_tag(json.dumps(params.structural_tag))

    def _any_whitespace(self, params: StructuredOutputsParams) -> bool:
        return self.any_whitespace if params.any_whitespace is None else params.any_whitespace

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh matcher for one request (it can take back any number of accepted tokens:
        speculative drafts are given back after each position's mask)."""
        return self.xgrammar.GrammarMatcher(self.compile(params))

    def batch_fill(self, matchers: list, bitmask, indices: list[int]) -> None:
        """Fill bitmask row ``indices[i]`` from ``matchers[i]``: one by one for a few, else in
        one call (xgrammar's batch matcher, on its own threads, which cost more than they save
        for a few rows)."""
        if len(matchers) < BATCH_FILL_MIN:
            for matcher, index in zip(matchers, indices):
                matcher.fill_next_token_bitmask(bitmask, index)
            return
        if self._batch_matcher is None:
            self._batch_matcher = self.xgrammar.BatchGrammarMatcher(max_threads=2)
        self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, indices)

    def allocate_bitmask(self, num_rows: int):
        return self.xgrammar.allocate_token_bitmask(num_rows, self.vocab_size)


class LazyGrammarBackend:
    """``backend()`` builds the GrammarBackend on first use (xgrammar and the vocabulary scan
    cost start-up time an engine without structured output should not pay)."""

    def __init__(self, *args: Any, **kwargs: Any):
        """The arguments of ``GrammarBackend``."""
        self._args, self._kwargs = args, kwargs
        self._backend = None
        self._lock = threading.Lock()

    @property
    def any_whitespace(self) -> bool:
        """Whether JSON may hold free whitespace when a request does not say."""
        return self._kwargs.get("any_whitespace", False)

    def __reduce__(self):  # to a tensor-parallel worker, which builds its own when first used
        return (_lazy_backend, (self._args, self._kwargs))

    def __call__(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                try:
                    self._backend = GrammarBackend(*self._args, **self._kwargs)
                except ImportError as exc:
                    raise ValueError(
                        f"structured_outputs needs xgrammar, which cannot be imported ({exc}); "
                        "install it: pip install xgrammar"
                    ) from None
            return self._backend


def _lazy_backend(args: tuple, kwargs: dict) -> LazyGrammarBackend:
    return LazyGrammarBackend(*args, **kwargs)
