"""Benchmark workloads as token-id prompts, so any tokenizer and any OpenAI-compatible server works.

``random``: prompt and output lengths uniform in given ranges; ``prefix``: every request starts
with one shared prefix; ``sharegpt``: the first human turn and first reply of a ShareGPT JSON file.
All are seeded: the same arguments give the same requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Callable, Optional

import numpy as np

DATASETS = ("random", "prefix", "sharegpt")
# Token ids below this are left out of random prompts: small ids are often BOS/EOS/pad/unk.
FIRST_PLAIN_TOKEN_ID = 4


@dataclasses.dataclass(frozen=True, slots=True)
class BenchRequest:
    """One benchmark request: its prompt as token ids and how many tokens it should generate."""

    prompt_token_ids: tuple[int, ...]
    output_len: int


def _check_range(name: str, low: int, high: int) -> None:
    if low < 1 or high < low:
        raise ValueError(f"{name} must be MIN MAX with 1 <= MIN <= MAX; got {low} {high}")


def _random_ids(rng: np.random.Generator, count: int, vocab_size: int) -> np.ndarray:
    low = min(FIRST_PLAIN_TOKEN_ID, vocab_size - 1)
    return rng.integers(low, vocab_size, size=count)


def random_requests(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """``num_requests`` random prompts, lengths uniform in ``input_len``, outputs in
    ``output_len``."""
    _check_range("--input-len", *input_len)
    _check_range("--output-len", *output_len)
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_len[0], input_len[1] + 1, size=num_requests)
    out_lens = rng.integers(output_len[0], output_len[1] + 1, size=num_requests)
    ids = _random_ids(rng, int(in_lens.sum()), vocab_size)
    chunks = np.split(ids, np.cumsum(in_lens)[:-1])
    return [BenchRequest(tuple(c.tolist()), int(n)) for c, n in zip(chunks, out_lens)]


def prefix_requests(
    num_requests: int,
    prefix_len: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Random requests whose prompts all begin with the same ``prefix_len`` random tokens."""
    if prefix_len < 1:
        raise ValueError(f"--prefix-len must be >= 1; got {prefix_len}")
    rng = np.random.default_rng(seed + 1_000_003)
    prefix = tuple(_random_ids(rng, prefix_len, vocab_size).tolist())
    tails = random_requests(num_requests, input_len, output_len, vocab_size, seed)
    return [BenchRequest(prefix + r.prompt_token_ids, r.output_len) for r in tails]


def sharegpt_requests(
    path: Path,
    encode: Callable[[str], list[int]],
    num_requests: int,
    seed: int = 0,
    output_len: Optional[int] = None,
    max_len: Optional[int] = None,
) -> list[BenchRequest]:
    """Requests from a ShareGPT JSON file: the first human turn as prompt, the reply's length as
    output.

    Conversations with fewer than two turns, or a prompt or reply under 4 tokens, are skipped;
    with ``max_len``, so are those whose prompt plus output exceed it. Order is shuffled by
    ``seed``.
    """
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the ShareGPT file {path}: {exc}") from exc
    if not isinstance(entries, list):
        raise ValueError(
            f"{path} is not a ShareGPT file: expected a JSON list of {{'conversations': [...]}}"
        )
    order = np.random.default_rng(seed).permutation(len(entries))
    requests: list[BenchRequest] = []
    for index in order:
        turns = entries[index].get("conversations") or []
        if len(turns) < 2:
            continue
        prompt = encode(turns[0]["value"])
        reply_len = output_len or len(encode(turns[1]["value"]))
        if len(prompt) < 4 or reply_len < 4 or (max_len and len(prompt) + reply_len > max_len):
            continue
        requests.append(BenchRequest(tuple(prompt), reply_len))
        if len(requests) == num_requests:
            return requests
    if not requests:
        raise ValueError(
            f"{path} holds no usable conversation "
            "(each needs a human turn and a reply of >= 4 tokens)"
        )
    return requests


def add_dataset_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--dataset`` flags shared by ``bench throughput`` and ``bench serve``."""
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset", choices=DATASETS, default="random")
    group.add_argument("--num-prompts", type=int, default=100, help="number of requests")
    group.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        default=(128, 128),
        metavar=("MIN", "MAX"),
        help="random/prefix: prompt length range (for prefix, the part after the shared prefix)",
    )
    group.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=(128, 128),
        metavar=("MIN", "MAX"),
        help="random/prefix: output length range",
    )
    group.add_argument(
        "--prefix-len", type=int, default=256, help="prefix: length of the shared prefix"
    )
    group.add_argument(
        "--dataset-path", type=Path, default=None, help="sharegpt: the ShareGPT JSON file"
    )
    group.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="sharegpt: fixed output length instead of the reply's",
    )
    group.add_argument("--dataset-seed", type=int, default=0)
    return parser


def load_requests(
    args: argparse.Namespace,
    vocab_size: int,
    encode: Optional[Callable[[str], list[int]]] = None,
    max_len: Optional[int] = None,
) -> list[BenchRequest]:
    """The requests ``args`` describe (see add_dataset_args)."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1; got {args.num_prompts}")
    if args.dataset == "random":
        return random_requests(
            args.num_prompts,
            tuple(args.input_len),
            tuple(args.output_len),
            vocab_size,
            args.dataset_seed,
        )
    if args.dataset == "prefix":
        return prefix_requests(
            args.num_prompts,
            args.prefix_len,
            tuple(args.input_len),
            tuple(args.output_len),
            vocab_size,
            args.dataset_seed,
        )
    if args.dataset_path is None or encode is None:
        raise ValueError(
            "--dataset sharegpt needs --dataset-path FILE.json and a tokenizer "
            "(--tokenizer or the model's)"
        )
    return sharegpt_requests(
        args.dataset_path,
        encode,
        args.num_prompts,
        args.dataset_seed,
        args.sharegpt_output_len,
        max_len,
    )
