"""A failure that belongs to one request fails that request alone: injected in the runner's set-up
of a new request (the step is undone and the others restart), in its logits processing or its
sampling after the forward pass (the others keep the step's tokens), and in building its output,
the neighbours in flight finish with their exact tokens, greedy and seeded, and every KV block
comes back."""

from __future__ import annotations

import pytest
from engine_helpers import assert_pool_clean, generate_ids, make_llm, shared_prefix_prompts

from octavo import SamplingParams
from octavo.model_executor import input_batch, logits_processors
from octavo.outputs.request_state import RequestState

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=99, max_tokens=24, ignore_eos=True)
NEIGHBOUR_PARAMS = [GREEDY, SEEDED, GREEDY, SEEDED, GREEDY, GREEDY]
POISON = 1.25  # the failing request is the one with this repetition_penalty
POISONED = SamplingParams(
    temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=POISON, logprobs=1
)


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

    def apply(self, row_logits, params, batch, row, num_tokens):
        if params.repetition_penalty == POISON:
            raise InjectedFault("planted in the request's penalties")
        return original(self, row_logits, params, batch, row, num_tokens)

    monkeypatch.setattr(logits_processors.SamplingPenalties, "_apply", apply)


def _fail_sampling(monkeypatch, llm) -> None:
    runner = llm.engine.core.runner
    sampler = runner.sampler

    def sample(logits, metadata):  # the poisoned row gets no token, as from NaN logits
        tokens = sampler(logits, metadata)
        rows = [
            i
            for i, row in enumerate(runner.input_batch.req_ids[: len(tokens)])
            if row.startswith("poisoned")
        ]
        tokens[rows] = logits.shape[-1]
        return tokens

    monkeypatch.setattr(runner, "sampler", sample)


def _fail_output(monkeypatch, llm) -> None:
    original = RequestState.append_tokens

    def append_tokens(self, new_token_ids, new_logprobs):
        if self.request_id.startswith("poisoned") and len(self.token_ids) >= 3:
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
    return [
        generate_ids(llm, [prompt], params)[0] for prompt, params in zip(prompts, NEIGHBOUR_PARAMS)
    ]


def run(engine, finals: dict, max_steps: int = 500) -> None:
    """Step until the engine is idle, collecting finished outputs (bounded, so that a broken
    recovery fails instead of hanging)."""
    for _ in range(max_steps):
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
        if not engine.has_unfinished_requests():
            return
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def assert_neighbours_unharmed(finals: dict, alone: list[list[int]]) -> None:
    for request_id, output in finals.items():
        index = int(request_id.split("-")[1])
        assert output.error is None
        assert list(output.outputs[0].token_ids) == alone[index], request_id
    assert len(finals) == len(alone)


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_failing_request_fails_alone_and_its_neighbours_keep_their_tokens(
    tiny_model, prompts, alone, monkeypatch, fault, enable_prefix_caching
):
    llm = make_llm(
        tiny_model, enable_prefix_caching=enable_prefix_caching, max_num_batched_tokens=64
    )
    FAULTS[fault](monkeypatch, llm)
    engine = llm.engine
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(f"early-{i}", {"prompt_token_ids": prompt}, NEIGHBOUR_PARAMS[i])
    finals = {}
    for _ in range(4):  # the early ones are past their prompts, mid-decode
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    engine.add_request("poisoned", {"prompt_token_ids": prompts[0]}, POISONED)  # shares a prefix
    for i, prompt in enumerate(prompts[3:], start=3):
        engine.add_request(f"late-{i}", {"prompt_token_ids": prompt}, NEIGHBOUR_PARAMS[i])
    run(engine, finals)

    failed = finals.pop("poisoned")
    assert failed.outputs[0].finish_reason == "error"
    assert "planted" in failed.error or "no token to sample" in failed.error, failed.error
    assert_neighbours_unharmed(finals, alone)
    assert_pool_clean(llm)
    # The engine goes on serving, the prefix cache included.
    assert generate_ids(llm, [prompts[0]], GREEDY) == [alone[0]]


def test_an_unattributable_step_failure_still_raises(tiny_model, prompts, monkeypatch):
    llm = make_llm(tiny_model)
    runner = llm.engine.core.runner

    def broken_forward(*args, **kwargs):
        raise InjectedFault("the device fell over")

    monkeypatch.setattr(runner, "forward", broken_forward)
    with pytest.raises(InjectedFault):
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("fault", ["state_setup", "sampling"])
def test_failures_in_consecutive_steps_each_fail_their_request_alone(
    tiny_model, prompts, alone, monkeypatch, fault
):
    llm = make_llm(tiny_model, max_num_batched_tokens=64, scheduling_policy="priority")
    FAULTS[fault](monkeypatch, llm)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"n-{i}", {"prompt_token_ids": prompt}, NEIGHBOUR_PARAMS[i])
    finals = {}
    for _ in range(3):
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    for k in range(3):  # one new failing request per step, three steps in a row
        engine.add_request(f"poisoned{k}", {"prompt_token_ids": prompts[k][:5]}, POISONED)
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    run(engine, finals)
    for k in range(3):
        assert finals.pop(f"poisoned{k}").outputs[0].finish_reason == "error"
    assert_neighbours_unharmed(finals, alone)
    assert_pool_clean(llm)


def test_aborting_samples_just_forked_or_released_frees_them(tiny_model, prompts):
    # Between two steps forked samples and released ones are already where an abort finds them.
    llm = make_llm(tiny_model, max_num_seqs=2)
    engine = llm.engine
    engine.add_request(
        "many", {"prompt_token_ids": prompts[1]}, SamplingParams(n=4, max_tokens=8, seed=1)
    )
    for _ in range(3):
        engine.step()
    engine.abort_request("many")
    assert not engine.has_unfinished_requests()
    assert_pool_clean(llm)
    assert generate_ids(llm, [prompts[0]], GREEDY) == [alone_greedy(tiny_model, prompts[0])]


def alone_greedy(tiny_model, prompt) -> list[int]:
    return generate_ids(make_llm(tiny_model), [prompt], GREEDY)[0]


def test_a_failed_child_ends_the_other_children(tiny_model, prompts, monkeypatch):
    original = RequestState.append_tokens

    def append_tokens(self, new_token_ids, new_logprobs):
        if self.request_id.startswith("1_") and len(self.token_ids) >= 2:  # sample 1 of the request
            raise InjectedFault("planted in one sample's detokenizing")
        return original(self, new_token_ids, new_logprobs)

    monkeypatch.setattr(RequestState, "append_tokens", append_tokens)
    llm = make_llm(tiny_model)
    (output,) = llm.generate(
        [{"prompt_token_ids": prompts[1]}],
        SamplingParams(n=3, max_tokens=16, seed=1, ignore_eos=True),
        use_tqdm=False,
    )
    assert output.finished and "planted" in (output.error or ""), output
    assert sorted(c.finish_reason for c in output.outputs) == ["abort", "abort", "error"]
    assert all(len(c.token_ids) < 16 for c in output.outputs), "the other children did not run on"
    assert_pool_clean(llm)


@pytest.mark.parametrize("scheduling_policy", ["fcfs", "priority"])
@pytest.mark.parametrize("num_steps", [0, 1])
def test_aborting_children_before_the_first_child_forks_frees_them(
    tiny_model, prompts, scheduling_policy, num_steps
):
    # The other children are released as the first is aborted; the next id aborted is one of them.
    llm = make_llm(tiny_model, max_num_batched_tokens=16, scheduling_policy=scheduling_policy)
    engine = llm.engine
    engine.add_request(
        "pair", {"prompt_token_ids": prompts[1]}, SamplingParams(n=2, max_tokens=8, seed=1)
    )
    for _ in range(num_steps):  # 0: still waiting; 1: mid chunked prefill
        engine.step()
    engine.abort_request("pair")
    assert not engine.has_unfinished_requests()
    assert_pool_clean(llm)
