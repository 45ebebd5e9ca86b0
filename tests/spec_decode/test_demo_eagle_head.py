"""The EAGLE, P-EAGLE and Gumiho heads shipped for the demo model load with it, keep its
greedy output, and draft well on code (their READMEs give the tokens per verify step at K = 4
on held-out files)."""

from __future__ import annotations

from pathlib import Path

import pytest

import octavo
from octavo import LLM, SamplingParams

DATA = Path(octavo.__file__).resolve().parent / "data"
PROMPTS = [
    'import os\n\n\ndef walk(top):\n    """Yield every file under top."""\n',
    'class Queue:\n    """A first-in, first-out queue."""\n\n    def __init__(self):\n',
]


@pytest.mark.parametrize(
    "folder,extra",
    [
        ("demo-model-eagle", {}),
        ("demo-model-p-eagle", {"parallel_drafting": True}),
        ("demo-model-gumiho", {"method": "gumiho"}),
    ],
    ids=("eagle", "p-eagle", "gumiho"),
)
def test_the_shipped_head_drafts_what_the_demo_model_writes(folder, extra):
    if not (DATA / folder / "model.safetensors").is_file():
        pytest.skip(f"the demo model's {folder} head is not present")
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(str(DATA / "demo-model"), kv_cache_memory="32MiB")
    head = {"method": "eagle", "model": str(DATA / folder), **extra}
    spec = LLM(
        str(DATA / "demo-model"),
        kv_cache_memory="32MiB",
        speculative_config={**head, "num_speculative_tokens": 4, "adaptive": False},
    )
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected
    assert spec.engine.core.scheduler.spec_stats.mean_acceptance_length > 1.8
