"""Incremental detokenisation: text as tokens arrive, never a broken UTF-8 character.

A fast (``tokenizers``-backed) tokenizer is streamed with the library's own
``tokenizers.decoders.DecodeStream``; any other tokenizer with a ``decode(ids,
skip_special_tokens=...)`` method gets the same prefix/read-offset technique in Python. Either
way each step decodes only the few tokens since the last emitted chunk, so a token costs O(1)
amortised, and text is held back while it ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded before the first output token, so that the output's first word gets
# its leading space and a prompt ending in a multi-byte character still decodes whole.
NUM_PROMPT_CONTEXT_TOKENS = 6


class TokenizerAdapter:
    """One tokenizer seen through the three calls the output path needs.

    Wraps a ``tokenizers.Tokenizer``, a transformers tokenizer (fast ones are used through their
    ``backend_tokenizer``), or any object with ``decode(ids, skip_special_tokens=...)``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        if isinstance(tokenizer, tokenizers.Tokenizer):
            self.backend: Optional[tokenizers.Tokenizer] = tokenizer
        else:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            self.backend = backend if isinstance(backend, tokenizers.Tokenizer) else None
        self.special_ids = self._special_ids()

    def _special_ids(self) -> frozenset[int]:
        if self.backend is not None:
            added = self.backend.get_added_tokens_decoder()
            return frozenset(token_id for token_id, token in added.items() if token.special)
        return frozenset(getattr(self.tokenizer, "all_special_ids", ()))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        """Decode a whole id sequence at once (through the backend when there is one, so that
        one-shot and streamed text agree; transformers' space clean-up is not applied)."""
        decoder = self.backend if self.backend is not None else self.tokenizer
        return decoder.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_each(self, token_ids: Sequence[int]) -> list[str]:
        """Each token decoded on its own (special tokens shown), in one library call if possible."""
        singles = [[token_id] for token_id in token_ids]
        if self.backend is not None:
            return self.backend.decode_batch(singles, skip_special_tokens=False)
        return [self.decode(ids, skip_special_tokens=False) for ids in singles]

    def new_stream(self, context_ids: Sequence[int], skip_special_tokens: bool) -> Any:
        """A streaming decoder primed with ``context_ids``; ``step(id)`` returns str or None."""
        if self.backend is not None:
            return _LibraryStream(self.backend, context_ids, skip_special_tokens)
        return PrefixOffsetStream(self.decode, context_ids, skip_special_tokens)


class _LibraryStream:
    """``tokenizers``' DecodeStream bound to its tokenizer."""

    __slots__ = ("_tokenizer", "_stream")

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, context_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(list(context_ids), skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> Optional[str]:
        return self._stream.step(self._tokenizer, token_id)


class PrefixOffsetStream:
    """The prefix/read-offset technique, for tokenizers without a library streaming decoder.

    Keeps the ids of the last emitted chunk as context (``prefix``); each step decodes context +
    pending ids and emits what extends the context's text, unless it ends mid-character.
    """

    __slots__ = ("_decode", "_skip", "_ids", "_prefix_text", "_num_prefix_ids")

    def __init__(self, decode: Any, context_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._decode = decode
        self._skip = skip_special_tokens
        self._ids = list(context_ids)
        self._prefix_text = decode(self._ids, skip_special_tokens) if self._ids else ""
        self._num_prefix_ids = len(self._ids)

    def step(self, token_id: int) -> Optional[str]:
        """Add one token; return the text it completes, or None while a character is incomplete."""
        self._ids.append(token_id)
        text = self._decode(self._ids, self._skip)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return None
        if not text.startswith(self._prefix_text):
            raise ValueError("decoded text does not extend its prefix")
        new_text = text[len(self._prefix_text) :]
        self._ids = self._ids[self._num_prefix_ids :]
        self._num_prefix_ids = len(self._ids)
        self._prefix_text = self._decode(self._ids, self._skip)
        return new_text


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas as they arrive.

    ``step(token_id)`` returns the newly complete text ("" while a multi-byte character is still
    split across tokens); ``flush()`` at the end returns what is still held (an incomplete
    character decodes to U+FFFD, as ``tokenizer.decode`` renders it). All deltas joined equal the
    output decoded after the prompt's last few tokens (for byte-level BPE, exactly
    ``tokenizer.decode(output_ids)``; SentencePiece-style tokenizers keep the first word's
    leading space, as vLLM does). Tokens wait only while their text ends in an incomplete
    character, so at most 3 wait in well-formed output; only invalid byte runs wait longer.
    """

    __slots__ = ("_adapter", "_skip", "_skipped_ids", "_stream", "_context_ids", "_pending_ids")

    def __init__(
        self, adapter: TokenizerAdapter, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self._adapter = adapter
        self._skip = skip_special_tokens
        self._skipped_ids = adapter.special_ids if skip_special_tokens else frozenset()
        self._context_ids = self._prompt_context(prompt_token_ids)
        self._pending_ids: list[int] = []
        self._stream = adapter.new_stream(self._context_ids, skip_special_tokens)

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        # A prompt cut mid-character cannot be extended cleanly: decode the output on its own.
        if context and self._adapter.decode(context, self._skip).endswith(REPLACEMENT_CHAR):
            return []
        return context

    def step(self, token_id: int) -> str:
        """Feed one output token; return the text it makes complete ("" if none yet)."""
        if token_id in self._skipped_ids:
            return ""  # decode() drops skipped special tokens before decoding, so they add nothing
        self._pending_ids.append(token_id)
        try:
            text = self._stream.step(token_id)
        except Exception:  # noqa: BLE001 — a decoder whose text is not prefix-stable here
            # Emit what the unemitted tokens decode to and continue with them as context.
            text = self._decode_pending()
            self._stream = self._adapter.new_stream(self._pending_ids, self._skip)
        if text is None:
            return ""
        self._context_ids, self._pending_ids = self._pending_ids, []
        return text

    def flush(self) -> str:
        """Text still held back at the end of the output (an incomplete character as U+FFFD)."""
        text = self._decode_pending() if self._pending_ids else ""
        self._pending_ids = []
        return text

    def _decode_pending(self) -> str:
        context, pending = self._context_ids, self._pending_ids
        full = self._adapter.decode(context + pending, self._skip)
        prefix = self._adapter.decode(context, self._skip) if context else ""
        if full.startswith(prefix):
            return full[len(prefix) :]
        return self._adapter.decode(pending, self._skip)
