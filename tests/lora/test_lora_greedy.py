"""Greedy output per adapter equals transformers + PEFT with the same adapter, for four
adapters of different ranks and target sets and the base model mixed in one batch, with chunked
prefill, preemption and prefix caching on; a seeded sampled request is the same alone and
batched; the scheduler keeps a step within --max-loras adapters."""

from __future__ import annotations

import random

import pytest
import torch
from pool_checks import assert_pool_clean  # noqa: E402  (tests/pool_checks.py)

from octavo import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
NAMES = [None, "attn-r4", "mlp-r8", "all-r16", "kvo-r8-rslora"]


def prompts(num: int, seed: int = 0) -> list[list[int]]:
    """Prompts in two families sharing a 40-token prefix (prefix-cache hits within an adapter),
    3-50 own tokens each."""
    rng = random.Random(seed)
    prefixes = [[1] + [rng.randrange(3, 512) for _ in range(40)] for _ in range(2)]
    return [
        prefixes[i % 2] + [rng.randrange(3, 512) for _ in range(rng.randrange(3, 50))]
        for i in range(num)
    ]


def lora_requests(adapters) -> dict:
    return {
        name: None if name is None else LoRARequest(name, i, str(adapters[name]))
        for i, name in enumerate(NAMES)
    }


@pytest.fixture(scope="module")
def peft_greedy(base_model, adapters):
    """(adapter name, prompt) -> PEFT's greedy tokens."""
    import peft
    import transformers

    expected = {}
    for name in NAMES:
        model = transformers.AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, adapters[name])
        model.eval()
        for prompt in prompts(8):
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10
                )
            expected[(name, tuple(prompt))] = out[0, len(prompt) :].tolist()
    return expected


def run_mixed(llm: LLM, adapters) -> list:
    """Every prompt under every adapter and the base, in one call: (name, prompt, tokens)."""
    requests = lora_requests(adapters)
    cases = [(name, p) for p in prompts(8) for name in NAMES]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for _, p in cases],
        GREEDY,
        lora_request=[requests[name] for name, _ in cases],
        use_tqdm=False,
    )
    assert_pool_clean(llm)
    return [(name, p, list(o.outputs[0].token_ids)) for (name, p), o in zip(cases, outputs)]


@pytest.mark.parametrize(
    "engine_args",
    [
        # 4 slots for 4 adapters; chunks of 64 tokens; 40 blocks: preemption by recompute
        dict(max_loras=4, max_num_batched_tokens=64, kv_cache_memory=40 * 8192),
        # 2 slots for 4 adapters: requests wait for a slot, slots change adapters; swap
        dict(
            max_loras=2,
            max_num_batched_tokens=96,
            kv_cache_memory=40 * 8192,
            preemption_mode="swap",
            swap_space=0.01,
        ),
    ],
    ids=["4-slots-recompute", "2-slots-swap"],
)
def test_mixed_batch_equals_peft(base_model, adapters, peft_greedy, engine_args):
    llm = LLM(
        str(base_model),
        enable_lora=True,
        max_lora_rank=16,
        max_num_seqs=16,
        enable_prefix_caching=True,
        **engine_args,
    )
    results = run_mixed(llm, adapters)
    for name, prompt, tokens in results:
        assert tokens == peft_greedy[(name, tuple(prompt))], (name, prompt[:5])
    core = llm.engine.core
    assert core.scheduler.stats.num_preempted_total > 0, "the case should preempt"
    assert core.kv_cache_manager.prefix_cache_hits > 0, "the case should hit the prefix cache"
    by_adapter = {name: [t for n, _, t in results if n == name] for name in NAMES}
    for name in NAMES[1:]:  # each adapter changes the output: the test can see a lost delta
        assert by_adapter[name] != by_adapter[None], name


def test_a_seeded_sampled_request_is_the_same_alone_and_batched(base_model, adapters):
    requests = lora_requests(adapters)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    prompt = {"prompt_token_ids": prompts(1, seed=3)[0]}
    llm = LLM(str(base_model), enable_lora=True, max_loras=4, kv_cache_memory="8MiB")
    (alone,) = llm.generate([prompt], sampled, lora_request=requests["all-r16"], use_tqdm=False)
    others = [{"prompt_token_ids": p} for p in prompts(6, seed=4)]
    batch = llm.generate(
        others[:3] + [prompt] + others[3:],
        [GREEDY] * 3 + [sampled] + [GREEDY] * 3,
        lora_request=[requests[n] for n in ("mlp-r8", None, "attn-r4")]
        + [requests["all-r16"]]
        + [requests[n] for n in ("kvo-r8-rslora", "all-r16", None)],
        use_tqdm=False,
    )
    assert list(batch[3].outputs[0].token_ids) == list(alone.outputs[0].token_ids)
    assert_pool_clean(llm)


def test_prefix_caching_isolates_adapters(base_model, adapters):
    """The same prompt under another adapter (or the base) never hits blocks another computed;
    under the same adapter it hits them."""
    requests = lora_requests(adapters)
    llm = LLM(str(base_model), enable_lora=True, max_loras=2, kv_cache_memory="8MiB")
    kv = llm.engine.core.kv_cache_manager
    prompt = [{"prompt_token_ids": prompts(1, seed=9)[0]}]  # 2+ full blocks of 16 tokens

    def hits_of(lora) -> int:
        before = kv.prefix_cache_hits
        llm.generate(prompt, GREEDY, lora_request=lora, use_tqdm=False)
        return kv.prefix_cache_hits - before

    assert hits_of(requests["attn-r4"]) == 0
    assert hits_of(requests["mlp-r8"]) == 0
    assert hits_of(None) == 0
    assert hits_of(requests["attn-r4"]) > 0
    assert hits_of(requests["mlp-r8"]) > 0
    assert hits_of(None) > 0


def test_a_step_never_runs_more_adapters_than_slots(base_model, adapters):
    requests = lora_requests(adapters)
    llm = LLM(str(base_model), enable_lora=True, max_loras=2, kv_cache_memory="8MiB")
    engine = llm.engine
    for i, p in enumerate(prompts(12, seed=11)):
        name = NAMES[i % len(NAMES)]
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY, lora_request=requests[name])
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        running = {r.lora_id for r in engine.core.scheduler.running if r.lora_id}
        most = max(most, len(running))
        assert len(running) <= 2, running
    assert most == 2
    assert_pool_clean(llm)
