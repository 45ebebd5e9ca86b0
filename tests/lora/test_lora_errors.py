"""Bad LoRA input is refused with an error saying what to do, offline (ConfigError/ValueError),
and never disturbs the requests in flight; an adapter whose files go missing after it was
checked fails its own requests alone."""

from __future__ import annotations

import json
import shutil

import pytest
from pool_checks import assert_pool_clean  # noqa: E402  (tests/pool_checks.py)

from octavo import LLM, LoRARequest, SamplingParams
from octavo.config import EngineArgs
from octavo.errors import ConfigError
from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = {"prompt_token_ids": [1, 9, 99, 199, 299, 399]}


@pytest.fixture(scope="module")
def llm(base_model) -> LLM:
    return LLM(str(base_model), enable_lora=True, max_loras=2, kv_cache_memory="8MiB")


def edited_copy(adapter, tmp_path, **config_changes):
    folder = tmp_path / "edited"
    shutil.copytree(adapter, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(config_changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def refusal(llm: LLM, path, lora_int_id: int = 77) -> str:
    with pytest.raises(ConfigError) as info:
        llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("x", lora_int_id, str(path)))
    return str(info.value)


def test_a_lora_request_without_enable_lora(base_model, adapters):
    plain = LLM(str(base_model), kv_cache_memory="8MiB")
    assert "--enable-lora" in refusal(plain, adapters["attn-r4"])


def test_adapters_that_do_not_fit_are_refused(llm, adapters, base_model, tmp_path):
    from octavo.testing.tiny_lora import write_random_lora

    wide = write_random_lora(tmp_path / "r32", base_model, rank=32)
    assert "raise --max-lora-rank to at least 32" in refusal(llm, wide)
    other = write_tiny_model(tmp_path / "other", TinyModelSpec(hidden_size=32, seed=3))
    assert "trained for another model" in refusal(llm, write_random_lora(tmp_path / "o", other))
    assert "is not a folder" in refusal(llm, tmp_path / "nothing-here")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no adapter_config.json" in refusal(llm, empty)
    no_weights = edited_copy(adapters["attn-r4"], tmp_path / "a")
    (no_weights / "adapter_model.safetensors").unlink()
    assert "safe_serialization=True" in refusal(llm, no_weights)
    corrupt = edited_copy(adapters["attn-r4"], tmp_path / "b")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 40)
    assert "cannot be read as safetensors" in refusal(llm, corrupt)
    saved = edited_copy(adapters["attn-r4"], tmp_path / "c", modules_to_save=["lm_head"])
    assert "modules_to_save" in refusal(llm, saved)
    dora = edited_copy(adapters["attn-r4"], tmp_path / "d", use_dora=True)
    assert "DoRA" in refusal(llm, dora)
    assert_pool_clean(llm)


def test_one_id_for_two_adapters_is_refused(llm, adapters):
    llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("a", 5, str(adapters["attn-r4"])))
    assert "give each adapter its own id" in refusal(llm, adapters["mlp-r8"], lora_int_id=5)


def test_bad_flags_and_requests(base_model):
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("a", 0, "/x")
    cases = {
        "--max-lora-rank must be one of": dict(max_lora_rank=7),
        "--max-cpu-loras \\(1\\) must be >= --max-loras \\(2\\)": dict(
            max_loras=2, max_cpu_loras=1
        ),
        "--tensor-parallel-size > 1": dict(tensor_parallel_size=2),
        "--no-enforce-eager": dict(enforce_eager=False),
        "speculative decoding with a draft model": dict(
            speculative_config={
                "method": "draft_model",
                "model": str(base_model),
                "num_speculative_tokens": 2,
            }
        ),
    }
    for message, args in cases.items():
        with pytest.raises(ConfigError, match=message):
            EngineArgs(model=str(base_model), enable_lora=True, **args)
    with pytest.raises(ConfigError, match="add --enable-lora"):
        EngineArgs(model=str(base_model), max_loras=4)


def test_refusals_do_not_disturb_requests_in_flight(llm, adapters, tmp_path):
    good = LoRARequest("mlp", 3, str(adapters["mlp-r8"]))
    (alone,) = llm.generate([PROMPT], GREEDY, lora_request=good, use_tqdm=False)
    engine = llm.engine
    engine.add_request("good", PROMPT, GREEDY, lora_request=good)
    engine.step()
    with pytest.raises(ConfigError):
        engine.add_request("bad", PROMPT, GREEDY, lora_request=LoRARequest("w", 9, str(tmp_path)))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert list(outputs["good"].outputs[0].token_ids) == list(alone.outputs[0].token_ids)
    assert_pool_clean(llm)


def test_an_adapter_gone_after_its_check_fails_its_requests_alone(llm, adapters, tmp_path):
    folder = tmp_path / "vanishing"
    shutil.copytree(adapters["all-r16"], folder)
    doomed = LoRARequest("vanishing", 11, str(folder))
    llm.engine.lora_registry.check(doomed)  # checked, as a served adapter is
    shutil.rmtree(folder)
    engine = llm.engine
    engine.add_request("doomed", PROMPT, GREEDY, lora_request=doomed)
    engine.add_request("base", PROMPT, GREEDY)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert outputs["doomed"].outputs[0].finish_reason == "error"
    assert "vanishing" in outputs["doomed"].error
    (base_alone,) = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    assert outputs["base"].outputs[0].token_ids == base_alone.outputs[0].token_ids
    assert_pool_clean(llm)


@pytest.mark.parametrize(
    "spec, what",
    [
        (TinyModelSpec("Qwen3MoeForCausalLM", num_experts=4), "Mixture-of-Experts"),
        (
            TinyModelSpec(
                "DeepseekV3ForCausalLM",
                extra_config=(
                    ("kv_lora_rank", 16),
                    ("qk_rope_head_dim", 8),
                    ("qk_nope_head_dim", 8),
                    ("v_head_dim", 8),
                    ("first_k_dense_replace", 2),
                    ("n_group", 1),
                    ("topk_group", 1),
                ),
            ),
            "multi-head latent attention",
        ),
    ],
    ids=["moe", "mla"],
)
def test_models_whose_layers_lora_cannot_adapt_are_refused(spec, what, tmp_path):
    folder = write_tiny_model(tmp_path / spec.architecture, spec)
    with pytest.raises(ConfigError, match=f"--enable-lora: .*{spec.architecture} \\({what}\\)"):
        LLM(str(folder), enable_lora=True, kv_cache_memory="8MiB")
