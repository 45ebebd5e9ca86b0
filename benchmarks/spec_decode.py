"""Speculative decoding on the bundled demo model, side by side in one run: output tokens per
second without speculation, with n-gram drafts, a draft model and the shipped EAGLE, P-EAGLE
and Gumiho heads.

    python benchmarks/spec_decode.py                      # code-b1, random-b32; 3 rounds
    python benchmarks/spec_decode.py --rounds 1 --out /tmp/spec.json
    python benchmarks/spec_decode.py --workloads heldout-b1,heldout-b16 \
        --configs ngram-every,eagle,eagle-every --num-speculative-tokens 2,4,6

Workloads (greedy, EOS ignored):
- ``code-b1``: one request at a time; each prompt is a short Python function followed by the
  start of the same function with one change (renamed), so the model's continuation repeats
  text the prompt holds: the case prompt lookup is for.
- ``random-b32``: 32 requests at once of random token ids (64-192 tokens), the case where
  drafts rarely match.
- ``heldout-b1`` / ``heldout-b16``: the first 128 tokens of standard-library files the demo
  model and its EAGLE head never trained on (the held-out split), one at a time / 16 at once.

Draft model: the demo model's first layer with its own embeddings, final norm and head (a
layer-skip draft with the target's trained weights and tokenizer, written to a temporary
folder), so its acceptance is that of a real, cheaper model.

Configurations are alternated round by round (the host is noisy); each figure is the median of
its rounds, and the speed-up is printed twice: the ratio of the medians, and the median of each
round's ratio against that round's run without speculation (paired: on a host whose speed
drifts from round to round, the steadier of the two). The acceptance figures come from the
engine's own counters (over the drafts that were scheduled: the adaptive policy schedules
fewer).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
from octavo import LLM, SamplingParams
from safetensors.torch import load_file, save_file

from octavo.bench.datasets import random_requests
from octavo.bench.report import spec_decode_report

DATA = Path(__file__).resolve().parent.parent / "core" / "octavo" / "data"
DEMO = DATA / "demo-model"
EAGLE_HEAD = DATA / "demo-model-eagle"
P_EAGLE_HEAD = DATA / "demo-model-p-eagle"
GUMIHO_HEAD = DATA / "demo-model-gumiho"
# The demo model's corpus rule (scripts/demo_model/corpus.py): folders that are not library
# source; its held-out files are the same hash split train-draft uses.
NOT_LIBRARY = ("site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data")

FUNCTIONS = [
    '''def count_words(text):
    """Return a dict mapping each word of text to how often it occurs."""
    counts = {}
    for word in text.split():
        word = word.lower()
        if word in counts:
            counts[word] += 1
        else:
            counts[word] = 1
    return counts
''',
    '''def read_config(path):
    """Read key = value lines from path into a dict, skipping comments."""
    result = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            result[key.strip()] = value.strip()
    return result
''',
    '''def find_index(items, target):
    """Return the index of target in the sorted list items, or -1."""
    low, high = 0, len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1
''',
    '''class Stack:
    """A last-in, first-out stack."""

    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()
''',
]


def code_prompts() -> list[str]:
    """Each function, then its first line with the name changed: "repeat it with one change"
    (two changes of name per function)."""
    prompts = []
    for source in FUNCTIONS:
        first_line = source.splitlines()[0]
        name = first_line.split()[1].split("(")[0].rstrip(":")
        for suffix in ("_copy", "2"):
            prompts.append(f"{source}\n\n{first_line.replace(name, name + suffix)}\n")
    return prompts


def layer_skip_draft(folder: Path, num_layers: int = 1) -> Path:
    """The demo model cut to its first ``num_layers`` layers, in ``folder``."""
    config = json.loads((DEMO / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(DEMO / "model.safetensors")
    kept = {
        name: tensor
        for name, tensor in weights.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    save_file(kept, folder / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO / name, folder / name)
    return folder


def configs(draft: Path, k: int) -> dict[str, dict | None]:
    """No speculation, n-gram, the draft model and the EAGLE, P-EAGLE and Gumiho heads with the
    adaptive policy (the default), and each with every draft scheduled (``adaptive: false``) to
    show what the policy does."""
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    draft_model = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    eagle = {"method": "eagle", "model": str(EAGLE_HEAD), "num_speculative_tokens": k}
    p_eagle = {"method": "eagle", "model": str(P_EAGLE_HEAD), "num_speculative_tokens": k}
    p_eagle["parallel_drafting"] = True
    gumiho = {"method": "gumiho", "model": str(GUMIHO_HEAD), "num_speculative_tokens": k}
    return {
        "none": None,
        "ngram": ngram,
        "ngram-every": {**ngram, "adaptive": False},
        "draft_model": draft_model,
        "draft-every": {**draft_model, "adaptive": False},
        "eagle": eagle,
        "eagle-every": {**eagle, "adaptive": False},
        "p-eagle": p_eagle,
        "p-eagle-every": {**p_eagle, "adaptive": False},
        "gumiho": gumiho,
        "gumiho-every": {**gumiho, "adaptive": False},
    }


def head_folder_config(folder: Path, k: int) -> dict:
    """A draft head's folder run as its method names it (``--head``), every draft scheduled: a
    Gumiho head as ``gumiho``, an EAGLE head with mask inputs as P-EAGLE, else as ``eagle``."""
    from safetensors import safe_open

    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    config = {"model": str(folder), "num_speculative_tokens": k, "adaptive": False}
    if architecture == "GumihoHead":
        return {**config, "method": "gumiho"}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as weights:
        parallel = "mask_embedding" in weights.keys()
    return {**config, "method": "eagle", **({"parallel_drafting": True} if parallel else {})}


def held_out_prompts(num: int, tokenizer) -> list[list[int]]:
    """The first 128 tokens of ``num`` held-out standard-library files."""
    import sysconfig

    from octavo.train_draft.data import TextFiles, read_texts

    root = Path(sysconfig.get_paths()["stdlib"])
    files = TextFiles.find(root, "*.py", [*NOT_LIBRARY, "__pycache__"])
    texts = [t for t in read_texts(files.held_out) if len(t) > 2000][:num]
    return [tokenizer(text)["input_ids"][:128] for text in texts]


def run_batch(llm: LLM, prompts: list[list[int]], max_tokens: int, batch: int):
    """``prompts`` in groups of ``batch`` requests at once: ``(output tok/s, token ids)``."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    token_ids = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = [{"prompt_token_ids": p} for p in prompts[i : i + batch]]
        outputs = llm.generate(group, params, use_tqdm=False)
        token_ids += [list(o.outputs[0].token_ids) for o in outputs]
    return sum(map(len, token_ids)) / (time.perf_counter() - start), token_ids


def run_code_b1(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens, outputs = 0, []
    start = time.perf_counter()
    for prompt in prompts:  # one request in flight at a time
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        tokens += len(output.outputs[0].token_ids)
        outputs.append(list(output.outputs[0].token_ids))
    return tokens / (time.perf_counter() - start), outputs


def run_random_b32(llm: LLM, max_tokens: int, seed: int) -> tuple[float, list[list[int]]]:
    requests = random_requests(32, (64, 192), (max_tokens, max_tokens), 4096, seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests], params, use_tqdm=False
    )
    elapsed = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    return sum(map(len, token_ids)) / elapsed, token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--num-speculative-tokens",
        default="4",
        help="K, or several (2,4,6): each configuration runs once per K",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument(
        "--workloads", default="code-b1,random-b32", help="comma-separated subset to run"
    )
    parser.add_argument(
        "--configs",
        default="none,ngram,ngram-every,draft_model,draft-every",
        help="comma-separated subset to run ('none' is always run: the speed-ups are against it)",
    )
    parser.add_argument(
        "--head",
        action="append",
        default=[],
        metavar="NAME=FOLDER",
        help="also run the draft head in FOLDER as configuration NAME, every draft scheduled "
        "(for example a head before and after more training, side by side; repeatable)",
    )
    args = parser.parse_args()
    heads = dict(entry.split("=", 1) for entry in args.head)
    chosen = {"none", *args.configs.split(","), *heads}
    ks = [int(k) for k in args.num_speculative_tokens.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        draft = layer_skip_draft(Path(tmp) / "demo-1-layer")
        engines = {}
        for k in ks:
            every = configs(draft, k)
            every.update({name: head_folder_config(Path(f), k) for name, f in heads.items()})
            for name, config in every.items():
                if name in chosen and (config is not None or "none" not in engines):
                    label = name if config is None or len(ks) == 1 else f"{name}-k{k}"
                    engines[label] = LLM(
                        str(DEMO), kv_cache_memory="256MiB", speculative_config=config
                    )
        prompts = code_prompts()
        held_out = held_out_prompts(16, engines["none"].get_tokenizer())
        workloads = {
            "code-b1": lambda llm: run_code_b1(llm, prompts, args.max_tokens),
            "random-b32": lambda llm: run_random_b32(llm, args.max_tokens, seed=0),
            "heldout-b1": lambda llm: run_batch(llm, held_out[:8], args.max_tokens, 1),
            "heldout-b16": lambda llm: run_batch(llm, held_out, args.max_tokens, 16),
        }
        workloads = {w: run for w, run in workloads.items() if w in args.workloads.split(",")}
        figures: dict = {w: {name: [] for name in engines} for w in workloads}
        acceptance: dict = {w: {} for w in workloads}
        outputs: dict = {w: {} for w in workloads}
        for workload, run in workloads.items():
            for name, llm in engines.items():  # warm-up round, also the outputs compared
                before = spec_decode_report(llm.engine)
                _, outputs[workload][name] = run(llm)
                after = spec_decode_report(llm.engine)
                acceptance[workload][name] = _acceptance_between(before, after)
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    figures[workload][name].append(run(llm)[0])
    report = {}
    for workload in workloads:
        base_rounds = figures[workload]["none"]
        base = statistics.median(base_rounds)
        for name in engines:
            tok_s = statistics.median(figures[workload][name])
            same = outputs[workload][name] == outputs[workload]["none"]
            # Each round runs every engine in turn: its ratio against that round's run without
            # speculation holds on a host whose speed drifts between rounds.
            paired = statistics.median(a / b for a, b in zip(figures[workload][name], base_rounds))
            row = {
                "output_tok_s": tok_s,
                "speedup": tok_s / base,
                "paired_speedup": paired,
                "same_tokens": same,
            }
            row.update(acceptance[workload][name])
            row["rounds"] = figures[workload][name]
            report[f"{workload}/{name}"] = row
            print(
                f"{workload:11s} {name:12s} {tok_s:9.1f} tok/s  x{tok_s / base:4.2f}  "
                f"paired x{paired:4.2f}  "
                f"acceptance length {row.get('mean_acceptance_length', 1.0):.2f}  "
                f"same tokens: {same}"
            )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


def _acceptance_between(before: dict, after: dict) -> dict:
    if not after:
        return {}
    drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
    draft_tokens = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    return {
        "num_drafts": drafts,
        "acceptance_rate": accepted / max(draft_tokens, 1),
        "mean_acceptance_length": 1 + accepted / max(drafts, 1),
    }


if __name__ == "__main__":
    main()
