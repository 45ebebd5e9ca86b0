"""The EAGLE head shipped for the demo model loads with it, keeps its greedy output, and drafts
well on code (its README says 3.22 tokens per verify step at K = 4 on held-out files)."""

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


def test_the_shipped_head_drafts_what_the_demo_model_writes():
    if not (DATA / "demo-model-eagle" / "model.safetensors").is_file():
        pytest.skip("the demo model's EAGLE head is not present")
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(str(DATA / "demo-model"), kv_cache_memory="32MiB")
    head = {"method": "eagle", "model": str(DATA / "demo-model-eagle")}
    spec = LLM(
        str(DATA / "demo-model"),
        kv_cache_memory="32MiB",
        speculative_config={**head, "num_speculative_tokens": 4, "adaptive": False},
    )
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected
    assert spec.engine.core.scheduler.spec_stats.mean_acceptance_length > 1.8
