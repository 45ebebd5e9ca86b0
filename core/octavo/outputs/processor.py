"""From the engine core's per-step token deltas to the RequestOutputs users see.

The engine core reports, per step and per engine request, the new token ids (and logprobs when
asked). The OutputProcessor detokenises them, applies every stop condition, says which requests
it finished so the core can free them, and builds RequestOutputs: cumulative, delta (streaming)
or final-only, one per user request, with the ``n`` samples of a request gathered together.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable, Optional, Sequence

from octavo.engine.core_output import EngineCoreOutput
from octavo.model_executor.runner_output import StepLogprobs
from octavo.outputs.detokenizer import TokenizerAdapter
from octavo.outputs.logprobs import build_logprob_dicts
from octavo.outputs.request_state import RequestState
from octavo.outputs.stop_checker import StopChecker
from octavo.outputs.types import FinishReason, PromptLogprobs, RequestMetrics, RequestOutput
from octavo.sampling_params import SEED_MAX, RequestOutputKind, SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class ChildRequest:
    """One engine request to schedule for a user request (its parent): sample ``index`` of its
    ``n``.

    With n == 1 the engine request id is the user's; otherwise ``"{index}_{request_id}"``, with
    ``n=1`` and, when seeded, ``seed + index`` in its params. The children of one parent share
    its prompt, so the core may fork their KV blocks.
    """

    request_id: str
    parent_request_id: str
    index: int
    sampling_params: SamplingParams


@dataclasses.dataclass(slots=True)
class ProcessedOutputs:
    """One call's results: outputs for users, and the engine requests the core must now free:
    ``reqs_finished`` ended here (a stop condition or the length), ``reqs_aborted`` were aborted
    (by the user, or because another child of their parent failed), ``reqs_failed`` could not
    have their output built."""

    request_outputs: list[RequestOutput] = dataclasses.field(default_factory=list)
    reqs_finished: list[str] = dataclasses.field(default_factory=list)
    reqs_aborted: list[str] = dataclasses.field(default_factory=list)
    reqs_failed: list[str] = dataclasses.field(default_factory=list)


class ParentRequest:
    """A user request: its samples, its prompt (and prompt logprobs) and its metrics."""

    def __init__(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_kind = params.output_kind
        self.children: list[RequestState] = []
        self.num_unfinished = 0  # kept by the OutputProcessor as samples finish
        self.prompt_logprobs: Optional[PromptLogprobs] = (
            [None] if params.prompt_logprobs is not None else None
        )
        self._num_sent_prompt_logprobs = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.error: Optional[str] = None  # why the engine failed a sample, if it did

    @property
    def finished(self) -> bool:
        """True once every sample has finished."""
        return self.num_unfinished == 0

    def add_prompt_logprobs(self, step: StepLogprobs, adapter: Optional[TokenizerAdapter]) -> None:
        """Append newly computed prompt positions' logprobs."""
        if self.prompt_logprobs is None:
            return
        dicts, _ = build_logprob_dicts(step, self.params.prompt_logprobs, adapter)
        self.prompt_logprobs.extend(dicts)

    def make_output(self) -> Optional[RequestOutput]:
        """This step's RequestOutput for the user, or None when there is nothing to send."""
        finished = self.finished
        kind = self.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        fresh = [child for child in self.children if child.has_unsent()]
        if not fresh:
            return None  # e.g. a prefill chunk: nothing new for the user yet
        children = fresh if kind == RequestOutputKind.DELTA else self.children
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is not None and kind == RequestOutputKind.DELTA:
            # Positions not sent yet (all of them with the first output), else None.
            prompt_logprobs = prompt_logprobs[self._num_sent_prompt_logprobs :] or None
            self._num_sent_prompt_logprobs = len(self.prompt_logprobs)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=[child.completion_output() for child in children],
            finished=finished,
            metrics=self.metrics,
            error=self.error,
        )


class OutputProcessor:
    """Turns engine-core deltas into RequestOutputs and decides when samples finish.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` or a transformers tokenizer (None: no text, no
    stop strings). ``eos_token_id`` is the default EOS for requests that do not give their own;
    ``max_model_len`` caps prompt + output ("length").
    """

    def __init__(
        self,
        tokenizer: Any,
        eos_token_id: Optional[int] = None,
        max_model_len: Optional[int] = None,
    ) -> None:
        self._adapter = TokenizerAdapter(tokenizer) if tokenizer is not None else None
        self._eos_token_id = eos_token_id
        self._max_model_len = max_model_len
        self._parents: dict[str, ParentRequest] = {}
        self._states: dict[str, RequestState] = {}
        self._parent_of: dict[str, ParentRequest] = {}

    def has_unfinished_requests(self) -> bool:
        """True while any user request is running."""
        return bool(self._parents)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prompt: Optional[str] = None,
        arrival_time: Optional[float] = None,
    ) -> list[ChildRequest]:
        """Register a user request (checked by the ``InputProcessor``); return the engine requests
        (its ``n`` samples) to schedule. A request id must not be running already."""
        if request_id in self._parents:
            raise ValueError(
                f"request_id {request_id!r} is already running; request ids must be unique"
            )
        prompt_token_ids = list(prompt_token_ids)
        max_output_tokens = self._max_output_tokens(len(prompt_token_ids), params)
        eos = self._eos_token_id
        parent = ParentRequest(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            time.time() if arrival_time is None else arrival_time,
        )
        children = _child_requests(request_id, params)
        delta = params.output_kind == RequestOutputKind.DELTA
        for child in children:
            checker = StopChecker(child.sampling_params, eos, max_output_tokens)
            state = RequestState(
                child.request_id,
                child.index,
                params,
                self._adapter,
                prompt_token_ids,
                checker,
                delta,
            )
            parent.children.append(state)
            parent.num_unfinished += 1
            self._states[child.request_id] = state
            self._parent_of[child.request_id] = parent
        self._parents[request_id] = parent
        return children

    def _max_output_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> Optional[int]:
        """``max_tokens`` capped by the room the context leaves (the input processor has made
        sure there is some)."""
        if self._max_model_len is None:
            return params.max_tokens
        room = self._max_model_len - num_prompt_tokens
        return room if params.max_tokens is None else min(room, params.max_tokens)

    def process_outputs(self, core_outputs: Iterable[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one step's deltas; return RequestOutputs and the engine requests to free."""
        now = time.time()
        touched: dict[str, ParentRequest] = {}
        processed = ProcessedOutputs()
        for core_output in core_outputs:
            state = self._states.get(core_output.request_id)
            if state is None:
                continue  # aborted or finished earlier; the core may still report it once
            parent = self._parent_of[core_output.request_id]
            try:
                self._process_one(core_output, state, parent, processed, now)
            except Exception as exc:  # noqa: BLE001 - its detokenizer or logprobs: fail it alone
                if state.finish_reason != FinishReason.ERROR:
                    parent.error = f"cannot build the output: {type(exc).__name__}: {exc}"
                    state.fail()
                processed.reqs_failed.append(core_output.request_id)
            touched[parent.request_id] = parent
            if state.finished:
                self._forget_state(state.request_id)
            if state.finish_reason == FinishReason.ERROR:
                processed.reqs_aborted += self._abort_other_children(parent)
        processed.request_outputs = self._collect(touched.values(), now)
        return processed

    def _abort_other_children(self, parent: ParentRequest) -> list[str]:
        """A child failed, so its parent fails: end the children still running (their engine
        requests, returned, must be freed)."""
        aborted = []
        for state in parent.children:
            if not state.finished:
                state.finish(FinishReason.ABORT, None)
                aborted.append(state.request_id)
                self._forget_state(state.request_id)
        return aborted

    def _process_one(
        self,
        core_output: EngineCoreOutput,
        state: RequestState,
        parent: ParentRequest,
        processed: ProcessedOutputs,
        now: float,
    ) -> None:
        """Apply one engine request's step: its tokens, logprobs, finish and metrics."""
        if core_output.error is not None:
            parent.error = core_output.error
        num_kept = state.append_tokens(core_output.new_token_ids, core_output.new_logprobs)
        if core_output.new_prompt_logprobs is not None and state.index == 0:
            parent.add_prompt_logprobs(core_output.new_prompt_logprobs, self._adapter)
        if core_output.finish_reason is not None:
            if not state.finished:
                state.finish(core_output.finish_reason, core_output.stop_reason)
        elif state.finished:
            processed.reqs_finished.append(core_output.request_id)
        _update_metrics(parent.metrics, num_kept, now)

    def abort_requests(self, request_ids: Iterable[str]) -> ProcessedOutputs:
        """Abort user requests: their final outputs (finish_reason "abort") and the engine
        requests the core must free. Unknown or finished ids are ignored."""
        now = time.time()
        touched: dict[str, ParentRequest] = {}
        aborted: list[str] = []
        for request_id in request_ids:
            parent = self._parents.get(request_id)
            if parent is None:
                continue
            for state in parent.children:
                if not state.finished:
                    state.finish(FinishReason.ABORT, None)
                    aborted.append(state.request_id)
                    self._forget_state(state.request_id)
            touched[request_id] = parent
        return ProcessedOutputs(self._collect(touched.values(), now), reqs_aborted=aborted)

    def _forget_state(self, engine_request_id: str) -> None:
        del self._states[engine_request_id]
        self._parent_of.pop(engine_request_id).num_unfinished -= 1

    def _collect(self, parents: Iterable[ParentRequest], now: float) -> list[RequestOutput]:
        request_outputs = []
        for parent in parents:
            if parent.finished:
                parent.metrics.finished_time = now
                del self._parents[parent.request_id]
            request_output = parent.make_output()
            if request_output is not None:
                request_outputs.append(request_output)
        return request_outputs


def _child_requests(request_id: str, params: SamplingParams) -> list[ChildRequest]:
    if params.n == 1:
        return [ChildRequest(request_id, request_id, 0, params)]
    children = []
    for index in range(params.n):
        seed = None if params.seed is None else _wrap_seed(params.seed + index)
        child_params = dataclasses.replace(params, n=1, seed=seed)
        children.append(ChildRequest(f"{index}_{request_id}", request_id, index, child_params))
    return children


def _wrap_seed(seed: int) -> int:
    """``seed`` brought back into the generator's range
    (a sample's seed is the request's + index)."""
    return seed - 2**64 if seed > SEED_MAX else seed


def _update_metrics(metrics: RequestMetrics, num_new_tokens: int, now: float) -> None:
    if num_new_tokens == 0:
        return
    if metrics.first_token_time is None:
        metrics.first_token_time = now
    elif now > metrics.last_token_time:  # a new step (a request's samples share one)
        metrics.token_gaps.append(now - metrics.last_token_time)
    metrics.last_token_time = now
    metrics.num_generation_tokens += num_new_tokens
