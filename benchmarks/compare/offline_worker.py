"""One offline run of one engine, in a process of its own (run.py starts it).

    python offline_worker.py SPEC.json RESULT.json

SPEC holds ``engine`` (vllm, octavo or transformers), ``model``, ``dtype``, ``prompts`` (token-id
lists), ``output_len``, the engine settings and optionally ``more_prompts`` (the prompt sets of
further timed passes); RESULT gets the timed seconds (the passes' median, each pass's in
``pass_seconds``), the output token count and every request's greedy output token ids (the first
pass's). vLLM runs here under its own virtual environment's Python, which has no octavo: nothing
of octavo is imported for it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

WARMUP_PROMPT = list(range(10, 42))
WARMUP_TOKENS = 8


def run_vllm(spec: dict) -> dict:
    """``vllm.LLM.generate`` on token-id prompts, greedy, EOS ignored (KV cache:
    $VLLM_CPU_KVCACHE_SPACE)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        spec["model"],
        dtype=spec["dtype"],
        enable_prefix_caching=spec["prefix_caching"],
        seed=0,
        max_num_seqs=spec["max_num_seqs"],
        max_model_len=spec["max_model_len"],
    )

    def generate(prompts, output_len):
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outputs], time.perf_counter() - start

    return timed(generate, spec)


def run_octavo(spec: dict) -> dict:
    """``octavo.LLM.generate`` via ``octavo.bench.throughput.run_throughput`` (as ``octavo bench
    throughput``)."""
    from octavo import LLM
    from octavo.bench.datasets import BenchRequest
    from octavo.bench.throughput import run_throughput

    llm = LLM(
        spec["model"],
        dtype=spec["dtype"],
        enable_prefix_caching=spec["prefix_caching"],
        seed=0,
        max_num_seqs=spec["max_num_seqs"],
        max_model_len=spec["max_model_len"],
        kv_cache_memory=f"{spec['kv_cache_gib']}GiB",
    )

    def generate(prompts, output_len):
        result = run_throughput(
            llm, [BenchRequest(tuple(p), output_len) for p in prompts], keep_token_ids=True
        )
        return result["token_ids"], result["elapsed_s"]

    return timed(generate, spec)


def run_transformers(spec: dict) -> dict:
    """transformers ``generate`` in static batches (benchmarks/throughput.py), greedy, EOS
    suppressed."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from throughput import run_transformers as hf_generate

    dtype = getattr(torch, spec["dtype"])
    batch = spec["hf_batch_size"]

    def generate(prompts, output_len):  # loads the model each call, outside its own timer
        result = hf_generate(Path(spec["model"]), prompts, output_len, dtype, batch)
        return result["tokens"], result["seconds"]

    return timed(generate, spec)


def timed(generate, spec: dict) -> dict:
    """One short warm-up generation, then the timed one over every prompt (``generate`` times
    itself), and one more over each further prompt set (``more_prompts``, as many prompts of the
    same lengths): ``seconds`` is the passes' median, the tokens are the first pass's."""
    generate([WARMUP_PROMPT], WARMUP_TOKENS)
    tokens, seconds = generate(spec["prompts"], spec["output_len"])
    passes = [seconds]
    for prompts in spec.get("more_prompts", []):
        more_tokens, more_seconds = generate(prompts, spec["output_len"])
        if sum(map(len, more_tokens)) != sum(map(len, tokens)):
            raise RuntimeError("a further pass made another number of output tokens")
        passes.append(more_seconds)
    return {
        "seconds": statistics.median(passes),
        "pass_seconds": passes,
        "output_tokens": sum(len(t) for t in tokens),
        "tokens": tokens,
    }


RUNNERS = {"vllm": run_vllm, "octavo": run_octavo, "transformers": run_transformers}


def main() -> None:
    spec_path, result_path = map(Path, sys.argv[1:3])
    spec = json.loads(spec_path.read_text())
    start = time.perf_counter()
    result = RUNNERS[spec["engine"]](spec)
    result["process_seconds"] = time.perf_counter() - start
    result_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
