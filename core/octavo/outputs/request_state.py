"""One sample's output as it grows: its tokens, text, logprobs and, in the end, why it stopped."""

from __future__ import annotations

from typing import Optional, Sequence

from octavo.model_executor.runner_output import StepLogprobs
from octavo.outputs.detokenizer import IncrementalDetokenizer, TokenizerAdapter
from octavo.outputs.logprobs import build_logprob_dicts
from octavo.outputs.stop_checker import StopChecker
from octavo.outputs.types import CompletionOutput, FinishReason, Logprob, StopReason
from octavo.sampling_params import SamplingParams


class RequestState:
    """The OutputProcessor's record of one engine request (one of a request's ``n`` samples).

    Text is kept as committed parts plus a short held-back suffix that could still turn into a
    stop string; outputs show only committed text until the sample finishes, so a stream never
    shows part of a stop string. Delta bookkeeping (what was already sent) lives here too.
    """

    def __init__(
        self,
        request_id: str,
        index: int,
        params: SamplingParams,
        adapter: Optional[TokenizerAdapter],
        prompt_token_ids: Sequence[int],
        stop_checker: StopChecker,
        delta: bool = False,
    ) -> None:
        self.request_id = request_id
        self.delta = delta
        self.index = index
        self.num_top_logprobs = params.logprobs
        self.adapter = adapter
        self.detokenizer = (
            IncrementalDetokenizer(adapter, prompt_token_ids, params.skip_special_tokens)
            if adapter is not None
            else None
        )
        self.stop_checker = stop_checker
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[dict[int, Logprob]]] = (
            [] if params.logprobs is not None else None
        )
        self.cumulative_logprob: Optional[float] = 0.0 if params.logprobs is not None else None
        self.finish_reason: Optional[FinishReason] = None
        self.stop_reason: StopReason = None
        self._text_parts: list[str] = []
        self._held_text = ""
        # Delta mode: how much has already gone out, and the text committed since then.
        self._num_sent_tokens = 0
        self._unsent_text_parts: list[str] = []
        self._sent_finish = False

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None

    def append_tokens(
        self, new_token_ids: Sequence[int], new_logprobs: Optional[StepLogprobs]
    ) -> int:
        """Take one step's new tokens, stopping at the first that ends the output.

        Returns how many of them were kept (the rest, after a stop, are dropped).
        """
        num_kept = 0
        for token_id in new_token_ids:
            num_kept += 1
            self.token_ids.append(token_id)
            self._consume_token(token_id)
            if self.finished:
                break
        if self.logprobs is not None and num_kept:
            assert new_logprobs is not None, (
                f"{self.request_id} asked for logprobs; the runner sent none"
            )
            dicts, chosen = build_logprob_dicts(
                new_logprobs, self.num_top_logprobs, self.adapter, num_kept
            )
            self.logprobs.extend(dicts)
            self.cumulative_logprob += sum(chosen)
        return num_kept

    def _consume_token(self, token_id: int) -> None:
        num_tokens = len(self.token_ids)
        checker = self.stop_checker
        token_stop = checker.check_token(token_id, num_tokens)
        # As vLLM: a stop token (EOS or stop_token_ids) is not rendered unless asked to be.
        rendered = token_stop is None or checker.include_stop_str_in_output
        if rendered and self.detokenizer is not None:
            self._append_text(self.detokenizer.step(token_id), checker.stops_enabled(num_tokens))
        if self.finished:
            return
        if token_stop is not None:
            self.finish(*token_stop)
        elif checker.reached_length(num_tokens):
            self.finish(FinishReason.LENGTH, None)

    def _append_text(self, new_text: str, stops_enabled: bool) -> None:
        if not new_text:
            return
        checker = self.stop_checker
        if not checker.stop_strings:
            self._commit(new_text)
            return
        include = checker.include_stop_str_in_output
        window = self._held_text + new_text
        match = checker.find_stop_string(window, len(self._held_text)) if stops_enabled else None
        if match is not None:
            end = match.end if include else match.start
            held = ""
        else:
            held = window[len(window) - checker.held_back_suffix(window) :]
            end = len(window) if include else len(window) - len(held)
        # With include_stop_str_in_output the held suffix is already visible, so nothing waits.
        self._commit(window[len(self._held_text) if include else 0 : end])
        self._held_text = held
        if match is not None:
            self.finish(FinishReason.STOP, match.stop)

    def _commit(self, text: str) -> None:
        if text:
            self._text_parts.append(text)
            if self.delta:
                self._unsent_text_parts.append(text)

    def finish(self, reason: FinishReason, stop_reason: StopReason) -> None:
        """End the sample: release held text (unless a stop string cut it) and set the reason."""
        assert not self.finished, f"{self.request_id} finished twice"
        reason = FinishReason(reason)  # the core may pass the plain string
        if reason == FinishReason.ERROR:
            self.fail()
            return
        self.finish_reason, self.stop_reason = reason, stop_reason
        if self.detokenizer is not None and not (
            reason == FinishReason.STOP and isinstance(stop_reason, str)
        ):
            tail = self._held_text + self.detokenizer.flush()
            self._commit(
                tail[len(self._held_text) :]
                if self.stop_checker.include_stop_str_in_output
                else tail
            )
        self._held_text = ""

    def fail(self) -> None:
        """End the sample with an error, keeping the text committed so far (nothing is flushed:
        the detokenizer may be what failed)."""
        self.finish_reason, self.stop_reason, self._held_text = FinishReason.ERROR, None, ""

    def text(self) -> str:
        """All committed text so far."""
        if len(self._text_parts) > 1:
            self._text_parts[:] = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    def has_unsent(self) -> bool:
        """True when a delta output would carry anything new."""
        return len(self.token_ids) > self._num_sent_tokens or (
            self.finished and not self._sent_finish
        )

    def completion_output(self) -> CompletionOutput:
        """This sample as a CompletionOutput: everything so far, or in delta mode only
        what is new."""
        if self.delta:
            start = self._num_sent_tokens
            text = "".join(self._unsent_text_parts)
            self._unsent_text_parts.clear()
        else:
            start, text = 0, self.text()
        self._num_sent_tokens = len(self.token_ids)
        self._sent_finish = self.finished
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.token_ids[start:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs[start:] if self.logprobs is not None else None,
            finish_reason=self.finish_reason.value if self.finish_reason is not None else None,
            stop_reason=self.stop_reason,
        )
