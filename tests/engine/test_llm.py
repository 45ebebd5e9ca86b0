"""The offline API end to end: seeded sampling, n > 1 by fork, beam search, overload, errors."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_pool_clean, generate_ids, make_llm, shared_prefix_prompts

from octavo import SamplingParams
from octavo.entrypoints.beam_search import BeamSearchParams
from octavo.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def llm(tiny_model):
    return make_llm(tiny_model)


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    prompts = shared_prefix_prompts(12, seed=5)
    seeded = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True
    )
    alone = generate_ids(llm, [prompts[0]], seeded)[0]
    others = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=5 + i, ignore_eos=True)
        for i in range(11)
    ]
    batched = generate_ids(
        llm, prompts[1:6] + [prompts[0]] + prompts[6:], others[:5] + [seeded] + others[5:]
    )
    assert batched[5] == alone
    different_seed = generate_ids(
        llm,
        [prompts[0]],
        SamplingParams(
            temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=20, ignore_eos=True
        ),
    )[0]
    assert different_seed != alone  # the seed matters: the check above can fail


def _peak_blocks(llm, requests) -> int:
    engine, kv = llm.engine, llm.engine.core.kv_cache_manager
    for request_id, (prompt, params) in enumerate(requests):
        engine.add_request(str(request_id), {"prompt_token_ids": prompt}, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, kv.block_pool.num_blocks - kv.num_free_blocks)
    assert_pool_clean(llm)
    return peak


def test_n_samples_share_the_prompt_blocks(tiny_model):
    llm = make_llm(tiny_model, enable_prefix_caching=False)
    prompt = shared_prefix_prompts(1, seed=9)[0] * 3  # ~100 tokens: six full blocks to share
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    separate = _peak_blocks(llm, [(prompt, params)] * 8)
    forked = _peak_blocks(
        llm, [(prompt, SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))]
    )
    assert forked <= separate / 2, (forked, separate)
    outputs = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    samples = [tuple(c.token_ids) for c in outputs[0].outputs]
    assert [c.index for c in outputs[0].outputs] == list(range(8))
    assert len(set(samples)) > 1 and all(len(s) == 8 for s in samples)
    assert_pool_clean(llm)


def test_n_greedy_samples_equal_the_single_greedy_output(llm):
    prompt = shared_prefix_prompts(2, seed=4)[1]
    single = generate_ids(
        llm, [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )[0]
    outputs = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(n=4, temperature=0.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    assert [list(c.token_ids) for c in outputs[0].outputs] == [single] * 4
    assert_pool_clean(llm)


@torch.no_grad()
def test_beam_search_matches_transformers(tiny_model, llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    for prompt in shared_prefix_prompts(3, seed=11):
        expected = hf.generate(
            torch.tensor([prompt]),
            num_beams=4,
            do_sample=False,
            max_new_tokens=10,
            eos_token_id=None,
            pad_token_id=0,
            length_penalty=1.0,
            early_stopping=False,
        )[0, len(prompt) :].tolist()
        result = llm.beam_search(
            [{"prompt_token_ids": prompt}],
            BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True),
        )
        assert list(result[0].sequences[0].output_token_ids) == expected
    assert_pool_clean(llm)


@pytest.mark.slow
def test_overload_300_requests_through_a_pool_for_a_tenth_of_them(tiny_model):
    prompts = shared_prefix_prompts(300, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    unconstrained = generate_ids(
        make_llm(tiny_model, max_num_seqs=300, max_num_batched_tokens=4096), prompts, params
    )
    blocks_needed = sum(-(-(len(p) + 8) // 16) for p in prompts)
    llm = make_llm(
        tiny_model,
        kv_cache_memory=max(blocks_needed // 10, 16) * 8192,
        max_num_seqs=300,
        max_num_batched_tokens=1024,
    )
    assert generate_ids(llm, prompts, params) == unconstrained
    assert llm.engine.core.scheduler.stats.num_preempted_total > 0


def test_streaming_deltas_add_up_to_the_final_output(llm):
    prompt = shared_prefix_prompts(1, seed=2)[0]
    final = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )[0]
    engine = llm.engine
    engine.add_request(
        "stream",
        {"prompt_token_ids": prompt},
        SamplingParams(
            temperature=0.0, max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        ),
    )
    tokens, text = [], ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += output.outputs[0].token_ids
            text += output.outputs[0].text
    assert tokens == list(final.outputs[0].token_ids) and text == final.outputs[0].text


def test_abort_frees_the_request_and_spares_the_others(llm):
    engine = llm.engine
    prompts = shared_prefix_prompts(3, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    engine.step()
    engine.step()
    (aborted,) = engine.abort_request("r1")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(finished) == {"r0", "r2"}
    assert [list(finished[r].outputs[0].token_ids) for r in ("r0", "r2")] == generate_ids(
        llm, [prompts[0], prompts[2]], params
    )


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "empty"),
        ("", SamplingParams(), "empty"),
        ([1, 2, 99999], SamplingParams(), r"token ids must be in \[0, 512\)"),
        ([1] * 300, SamplingParams(), "300 tokens.*max_model_len=256"),
        ([1, 2, 3], SamplingParams(max_tokens=None, stop=["x"], n=2), None),
    ],
)
def test_bad_prompts_raise_value_error_and_leave_the_engine_usable(llm, prompt, params, message):
    if message is None:
        outputs = llm.generate([prompt], params, use_tqdm=False)
        assert len(outputs[0].outputs) == 2
    else:
        with pytest.raises(ValueError, match=message):
            llm.generate(
                [prompt] if isinstance(prompt, str) else [{"prompt_token_ids": prompt}],
                params,
                use_tqdm=False,
            )
    assert_pool_clean(llm)
    assert generate_ids(llm, [[1, 5, 6]], SamplingParams(temperature=0, max_tokens=3)) != []


def test_chat_uses_the_tokenizer_chat_template():
    from importlib.resources import files

    from octavo import LLM

    demo = str(files("octavo") / "data" / "demo-model")
    llm = LLM(demo, kv_cache_memory="64MiB")
    tokenizer = llm.get_tokenizer()
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):"},
    ]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    (reply,) = llm.chat(messages, params, use_tqdm=False)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert reply.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert "You write Python." in tokenizer.decode(reply.prompt_token_ids)
    (direct,) = llm.generate([{"prompt_token_ids": reply.prompt_token_ids}], params, use_tqdm=False)
    assert reply.outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(ValueError, match="messages is empty"):
        llm.chat([[]], params, use_tqdm=False)
