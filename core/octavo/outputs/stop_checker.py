"""When one sample's output ends, and how much of its text must wait in case a stop string forms."""

from __future__ import annotations

from typing import NamedTuple, Optional

from octavo.outputs.types import FinishReason, StopReason
from octavo.sampling_params import SamplingParams


class StopMatch(NamedTuple):
    """A stop string found in a text window: where it starts and ends there, and which one."""

    start: int
    end: int
    stop: str


class StopChecker:
    """The stop conditions of one sample, from its SamplingParams.

    Token conditions: EOS (unless ``ignore_eos``; stop_reason None) and ``stop_token_ids``
    (stop_reason the id) end the output only after ``min_tokens`` tokens precede them; the
    output ends with "length" at ``max_output_tokens`` (``max_tokens``, capped by the model's
    length). Stop strings are searched only in text that a token past ``min_tokens`` produced.
    """

    __slots__ = (
        "eos_token_id",
        "stop_token_ids",
        "stop_strings",
        "min_tokens",
        "max_output_tokens",
        "include_stop_str_in_output",
        "_prefix_last_chars",
    )

    def __init__(
        self, params: SamplingParams, eos_token_id: Optional[int], max_output_tokens: Optional[int]
    ) -> None:
        self.eos_token_id = None if params.ignore_eos else eos_token_id
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.stop_strings: tuple[str, ...] = params.stop or ()
        self.min_tokens = params.min_tokens
        self.max_output_tokens = max_output_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # Characters that can end a proper prefix of a stop string: text ending in anything else
        # holds nothing back (the common case, checked in O(1)).
        self._prefix_last_chars = frozenset(
            stop[i] for stop in self.stop_strings for i in range(len(stop) - 1)
        )

    def stops_enabled(self, num_output_tokens: int) -> bool:
        """True once the token just appended (the ``num_output_tokens``-th) may end the output."""
        return num_output_tokens > self.min_tokens

    def check_token(
        self, token_id: int, num_output_tokens: int
    ) -> Optional[tuple[FinishReason, StopReason]]:
        """(STOP, stop_reason) if ``token_id``, the ``num_output_tokens``-th output token,
        ends it."""
        if not self.stops_enabled(num_output_tokens):
            return None
        if token_id == self.eos_token_id:
            return FinishReason.STOP, None
        if token_id in self.stop_token_ids:
            return FinishReason.STOP, token_id
        return None

    def reached_length(self, num_output_tokens: int) -> bool:
        """True when the output may not grow past ``num_output_tokens`` tokens."""
        return self.max_output_tokens is not None and num_output_tokens >= self.max_output_tokens

    def find_stop_string(self, window: str, new_start: int) -> Optional[StopMatch]:
        """The earliest stop string in ``window`` that ends in its new part ``window[new_start:]``.

        Ties at the same start go to the longer string. ``window`` must begin with the text's
        held-back suffix (see ``held_back_suffix``), so no earlier text can start a match.
        """
        best: Optional[StopMatch] = None
        for stop in self.stop_strings:
            start = window.find(stop, max(0, new_start - len(stop) + 1))
            if start < 0:
                continue
            if (
                best is None
                or start < best.start
                or (start == best.start and len(stop) > len(best.stop))
            ):
                best = StopMatch(start, start + len(stop), stop)
        return best

    def held_back_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string.

        That suffix may still become a stop string, so streaming must not show it yet; any text
        before it never can. At most ``len(longest stop) - 1`` characters.
        """
        if not text or text[-1] not in self._prefix_last_chars:
            return 0
        longest = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
