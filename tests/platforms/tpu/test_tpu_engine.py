"""`--device tpu` end to end under OCTAVO_PALLAS_INTERPRET=1: the JAX runner generates exactly the
cpu platform's greedy tokens (float32), through chunked prefill and prefix-cache hits, on every
Llama-family member; sampling, penalties and logprobs work; bad settings are refused at start-up
naming what the tpu platform supports."""

from __future__ import annotations

import pytest
from tpu_cases import engine, prompts, token_ids, write_model

from octavo import LLM, SamplingParams
from octavo.errors import ConfigError
from octavo.structured_output import StructuredOutputsParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# 44, 7, 23 and 2 tokens, with a 16-token step budget: prefills are chunked and share steps
# with the others' decodes.
PROMPTS = prompts((44, 7, 23, 2))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tpu_models")
    return {name: write_model(folder, name) for name in ("llama", "mistral", "qwen2", "qwen3")}


@pytest.mark.parametrize("name", ("llama", "mistral", "qwen2", "qwen3"))
def test_greedy_tokens_equal_the_cpu_platforms(models, name):
    expected = token_ids(engine(models[name], "cpu", max_num_batched_tokens=16), PROMPTS, GREEDY)
    llm = engine(models[name], "tpu", max_num_batched_tokens=16)
    assert type(llm.engine.core.runner).__name__ == "JaxModelRunner"
    assert token_ids(llm, PROMPTS, GREEDY) == expected
    # the same prompts again: their blocks come from the prefix cache
    assert token_ids(llm, PROMPTS, GREEDY) == expected
    assert llm.engine.core.kv_cache_manager.prefix_cache_hits > 0


def test_stories260k_greedy_text_equals_the_cpu_platforms(stories260k_path):
    texts = ["Once upon a time", "The little dog", "Lily and Tom went to the park and"]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    cpu = LLM(str(stories260k_path), device="cpu", dtype="float32", max_num_batched_tokens=32)
    tpu = LLM(str(stories260k_path), device="tpu", dtype="float32", max_num_batched_tokens=32)
    expected = [o.outputs[0].text for o in cpu.generate(texts, params, use_tqdm=False)]
    assert [o.outputs[0].text for o in tpu.generate(texts, params, use_tqdm=False)] == expected


def test_stories260k_forks_and_structured_output_equal_the_cpu_platforms(stories260k_path):
    """n > 1 children share their prompt's blocks (copy-on-write of the last one); a grammar
    masks the logits on the host and the JAX sampler draws from them."""
    forks = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=16)
    choice = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["dragon", "princess"]),
    )

    def run(device):
        llm = LLM(str(stories260k_path), device=device, dtype="float32")
        children = llm.generate(["Once upon a time"], forks, use_tqdm=False)[0].outputs
        chosen = llm.generate(["The story is about a"], choice, use_tqdm=False)[0].outputs[0]
        return [c.token_ids for c in children], chosen.text

    children, chosen = run("tpu")
    assert len(children) == 3 and len({tuple(c) for c in children}) > 1
    assert chosen in ("dragon", "princess")
    assert run("cpu")[1] == chosen


def test_bfloat16_runs_and_stays_close_to_float32(models):
    """bfloat16 rounds differently from float32, so only agreement early on is asserted."""
    f32 = token_ids(engine(models["llama"], "tpu"), PROMPTS, GREEDY)
    bf16 = token_ids(engine(models["llama"], "tpu", dtype="bfloat16"), PROMPTS, GREEDY)
    assert all(len(ids) == GREEDY.max_tokens for ids in bf16)
    assert sum(a[0] == b[0] for a, b in zip(f32, bf16)) >= 3


def test_seeded_sampling_repeats_whatever_the_batch(models):
    seeded = SamplingParams(
        temperature=0.9, top_k=40, top_p=0.9, min_p=0.01, seed=11, max_tokens=10, ignore_eos=True
    )
    plain = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    llm = engine(models["qwen2"], "tpu")
    alone = token_ids(llm, PROMPTS[:1], seeded)[0]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], [seeded] + [plain] * 3, use_tqdm=False
    )
    assert list(outputs[0].outputs[0].token_ids) == alone
    greedy = token_ids(llm, PROMPTS[:1], GREEDY)[0]
    assert alone != greedy  # it sampled


def test_penalties_and_logprobs_match_the_cpu_platform(models):
    """Rows that need the host (penalties, logprobs) run the core's logits processors on the
    logits the JAX model computed."""
    params = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3, logprobs=3
    )
    cpu = engine(models["llama"], "cpu").generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False
    )
    tpu = engine(models["llama"], "tpu").generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False
    )
    for c, t in zip(cpu, tpu):
        assert list(t.outputs[0].token_ids) == list(c.outputs[0].token_ids)
        for c_pos, t_pos in zip(c.outputs[0].logprobs, t.outputs[0].logprobs):
            assert c_pos.keys() == t_pos.keys()
            for token, entry in c_pos.items():
                assert t_pos[token].logprob == pytest.approx(entry.logprob, abs=1e-4)


@pytest.mark.parametrize(
    "args,message",
    [
        (dict(dtype="float16"), r"float32.*bfloat16|bfloat16.*float32"),
        (dict(block_size=8), r"block size 8 .*\[16, 32, 64, 128\]"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculat"),
        (dict(tensor_parallel_size=2), "tensor-parallel-size 1"),
    ],
    ids=("float16", "block-size-8", "speculative", "tp2"),
)
def test_unsupported_settings_are_refused_at_start_up(models, args, message):
    with pytest.raises(ConfigError, match=message):
        engine(models["llama"], "tpu", **args)
