"""A failure that belongs to one request fails that request alone: injected in the runner's set-up
of a new request, in its logits processing after the forward pass, and in building its output,
the neighbours in flight finish with their exact greedy tokens and every KV block comes back."""

from __future__ import annotations

import pytest

from engine_helpers import assert_pool_clean, generate_ids, make_llm, shared_prefix_prompts
from octavo import SamplingParams
from octavo.engine.request_state import RequestState
from octavo.model_executor import input_batch, logits_processors

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
POISON = 1.25  # the failing request is the one with this repetition_penalty


class InjectedFault(RuntimeError):
    """The failure the tests plant."""


def _fail_state_setup(monkeypatch, llm) -> None:
    original = input_batch.CachedRequestState.from_new.__func__

    def from_new(cls, new, device):
        if new.sampling_params.repetition_penalty == POISON:
            raise InjectedFault("planted in the request's set-up")
        return original(cls, new, device)

    monkeypatch.setattr(input_batch.CachedRequestState, "from_new", classmethod(from_new))


def _fail_logits_processing(monkeypatch, llm) -> None:
    original = logits_processors.SamplingPenalties._apply

    def apply(self, row_logits, params, batch, row):
        if params.repetition_penalty == POISON:
            raise InjectedFault("planted in the request's penalties")
        return original(self, row_logits, params, batch, row)

    monkeypatch.setattr(logits_processors.SamplingPenalties, "_apply", apply)


def _fail_sampling(monkeypatch, llm) -> None:
    runner = llm.engine.core.runner
    sampler = runner.sampler

    def sample(logits, metadata):  # the poisoned row gets no token, as from NaN logits
        tokens = sampler(logits, metadata)
        rows = [i for i, row in enumerate(runner.input_batch.req_ids[: len(tokens)]) if row == "poisoned"]
        tokens[rows] = logits.shape[-1]
        return tokens

    monkeypatch.setattr(runner, "sampler", sample)


def _fail_output(monkeypatch, llm) -> None:
    original = RequestState.append_tokens

    def append_tokens(self, new_token_ids, new_logprobs):
        if self.request_id == "poisoned" and len(self.token_ids) >= 3:
            raise InjectedFault("planted in the request's detokenizing")
        return original(self, new_token_ids, new_logprobs)

    monkeypatch.setattr(RequestState, "append_tokens", append_tokens)


FAULTS = {
    "state_setup": _fail_state_setup,
    "logits_processing": _fail_logits_processing,
    "sampling": _fail_sampling,
    "output": _fail_output,
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return shared_prefix_prompts(6, seed=3)


@pytest.fixture(scope="module")
def alone(tiny_model, prompts) -> list[list[int]]:
    llm = make_llm(tiny_model)
    return [generate_ids(llm, [prompt], GREEDY)[0] for prompt in prompts]


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_failing_request_fails_alone_and_its_neighbours_keep_their_tokens(
    tiny_model, prompts, alone, monkeypatch, fault, enable_prefix_caching
):
    llm = make_llm(tiny_model, enable_prefix_caching=enable_prefix_caching, max_num_batched_tokens=64)
    FAULTS[fault](monkeypatch, llm)
    engine = llm.engine
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(f"early-{i}", {"prompt_token_ids": prompt}, GREEDY)
    finals = {}
    for _ in range(4):  # the early ones are past their prompts, mid-decode
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    poisoned = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=POISON)
    engine.add_request("poisoned", {"prompt_token_ids": prompts[0]}, poisoned)  # shares a prefix
    for i, prompt in enumerate(prompts[3:], start=3):
        engine.add_request(f"late-{i}", {"prompt_token_ids": prompt}, GREEDY)
    for _ in range(500):  # a bound, so that a broken recovery fails instead of hanging
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
        if not engine.has_unfinished_requests():
            break

    failed = finals.pop("poisoned")
    assert failed.outputs[0].finish_reason == "error"
    assert "planted" in failed.error or "no valid token" in failed.error, failed.error
    for request_id, output in finals.items():
        index = int(request_id.split("-")[1])
        assert output.error is None
        assert list(output.outputs[0].token_ids) == alone[index], request_id
    assert len(finals) == len(prompts)
    assert_pool_clean(llm)
    # The engine goes on serving, the prefix cache included.
    assert generate_ids(llm, [prompts[0]], GREEDY) == [alone[0]]


def test_an_unattributable_step_failure_still_raises(tiny_model, prompts, monkeypatch):
    llm = make_llm(tiny_model)
    runner = llm.engine.core.runner

    def broken_forward(*args, **kwargs):
        raise InjectedFault("the device fell over")

    monkeypatch.setattr(runner, "model", broken_forward)
    with pytest.raises(InjectedFault):
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
