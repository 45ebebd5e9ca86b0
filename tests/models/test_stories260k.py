"""The real trained stories260K model reproduces its recorded reference outputs."""

from __future__ import annotations

import json

import pytest
import torch
from model_cases import blocks_needed
from paged_driver import Driver

from octavo.model_executor.tokenizer import load_tokenizer

pytestmark = pytest.mark.shared


@pytest.fixture(scope="module")
def reference(stories260k_path):
    return json.loads((stories260k_path / "reference_outputs.json").read_text())


def reference_cases(reference) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, expected new ids) of every recorded greedy continuation."""
    cases = [(r["prompt_ids"], r["new_ids"]) for r in reference["reference_outputs"]]
    for key in ("bos_greedy200", "once_upon_100"):
        cases.append((reference[key]["prompt_ids"], reference[key]["new_ids"]))
    return cases


@pytest.mark.parametrize(
    "block_size, chunk_size",
    [
        (16, None),
        pytest.param(1, 7, marks=pytest.mark.slow),
        pytest.param(128, 7, marks=pytest.mark.slow),
    ],
)
def test_reference_continuations_in_one_mixed_batch(
    stories260k_path, reference, make_runner, block_size, chunk_size
):
    cases = reference_cases(reference)
    runner = make_runner(stories260k_path, block_size=block_size)
    prompts = [prompt for prompt, _ in cases]
    driver = Driver(runner, blocks_needed(prompts, 200, block_size))
    for prompt, expected in cases:
        driver.add(prompt, max_tokens=len(expected))
    assert driver.run(chunk_size) == [expected for _, expected in cases]


def test_prompt_logits_match_transformers(stories260k_path, reference, make_runner, oracle):
    prompt = reference["prompt_ids"]["hf"]
    runner = make_runner(stories260k_path)
    captured = []
    runner.logits_processors.append(
        lambda logits, batch, rows, num_tokens: captured.append(logits.clone()) or logits
    )
    driver = Driver(runner, blocks_needed([prompt], 1, runner.block_size))
    driver.add(prompt, max_tokens=1)
    driver.step()
    logits = captured[0][0]
    torch.testing.assert_close(
        logits, oracle.last_logits(stories260k_path, prompt), rtol=0, atol=1e-4
    )
    assert logits.topk(5).indices.tolist() == reference["prompt_last_top5"]


def test_tokenizer_encodes_like_the_reference(stories260k_path, reference):
    tokenizer = load_tokenizer(stories260k_path)  # the engine's, cached or not
    for case in reference["reference_outputs"]:
        assert tokenizer.encode(case["prompt"]) == case["prompt_ids"]
        text = tokenizer.decode(case["prompt_ids"] + case["new_ids"], skip_special_tokens=True)
        assert text == case["text"]
