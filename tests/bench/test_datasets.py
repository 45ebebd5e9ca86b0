"""Benchmark datasets: seeded, shaped as asked, and inside the vocabulary."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from octavo.bench.datasets import prefix_requests, random_requests, sharegpt_requests


def test_random_requests_are_seeded_and_in_range():
    a = random_requests(50, (5, 20), (3, 7), vocab_size=100, seed=3)
    assert a == random_requests(50, (5, 20), (3, 7), vocab_size=100, seed=3)
    assert a != random_requests(50, (5, 20), (3, 7), vocab_size=100, seed=4)
    assert len(a) == 50
    assert all(5 <= len(r.prompt_token_ids) <= 20 and 3 <= r.output_len <= 7 for r in a)
    assert all(4 <= t < 100 for r in a for t in r.prompt_token_ids)
    assert {len(r.prompt_token_ids) for r in a} != {5}  # lengths vary across the range
    with pytest.raises(ValueError, match="--input-len"):
        random_requests(1, (10, 5), (1, 1), 100)


def test_prefix_requests_share_exactly_the_prefix():
    reqs = prefix_requests(
        10, prefix_len=32, input_len=(4, 8), output_len=(2, 2), vocab_size=1000, seed=1
    )
    prefix = reqs[0].prompt_token_ids[:32]
    assert all(r.prompt_token_ids[:32] == prefix for r in reqs)
    assert all(36 <= len(r.prompt_token_ids) <= 40 for r in reqs)
    assert len({r.prompt_token_ids[32:] for r in reqs}) == 10  # the tails differ
    assert reqs == prefix_requests(10, 32, (4, 8), (2, 2), 1000, seed=1)


def test_sharegpt_takes_first_turn_and_reply_length(tmp_path, bench_model):
    tokenizer = AutoTokenizer.from_pretrained(bench_model)
    convs = [
        {
            "conversations": [
                {"from": "human", "value": f"question {i} " * (i + 3)},
                {"from": "gpt", "value": "answer " * (i + 4)},
            ]
        }
        for i in range(6)
    ] + [{"conversations": [{"from": "human", "value": "alone"}]}, {"conversations": []}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    reqs = sharegpt_requests(path, tokenizer.encode, num_requests=4, seed=0)
    assert len(reqs) == 4 and reqs == sharegpt_requests(path, tokenizer.encode, 4, seed=0)
    expected = {
        tuple(tokenizer.encode(c["conversations"][0]["value"])): len(
            tokenizer.encode(c["conversations"][1]["value"])
        )
        for c in convs[:6]
    }
    assert all(expected[r.prompt_token_ids] == r.output_len for r in reqs)
    assert all(
        r.output_len == 9 for r in sharegpt_requests(path, tokenizer.encode, 4, output_len=9)
    )
    with pytest.raises(ValueError, match="cannot read"):
        sharegpt_requests(tmp_path / "missing.json", tokenizer.encode, 1)
