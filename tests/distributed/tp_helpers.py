"""What the tensor-parallel tests share (a unique module name: every test folder has a
conftest)."""

from __future__ import annotations

import socket

import psutil

from octavo import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1, 17, 99, 4], [1, 300, 2, 55, 81, 7, 9], [1, 5] * 20, [1, 250]]


def make_llm(model, tp: int, **engine_args) -> LLM:
    """An engine of ``tp`` ranks; ``kv_cache_memory`` is per rank, so a rank holding 1/tp of
    the KV heads gets 1/tp of the bytes and every size keeps the same block count."""
    kv_bytes = engine_args.pop("kv_cache_bytes", 8 << 20)
    engine_args.setdefault("max_num_batched_tokens", 512)
    return LLM(
        str(model),
        device="cpu",  # the cpu platform's gloo communicator is what runs here
        tensor_parallel_size=tp,
        dtype="float32",
        kv_cache_memory=kv_bytes // tp,
        **engine_args,
    )


def greedy_ids(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine.core.runner.processes]


def running(pids: list[int]) -> list[int]:
    """The pids still running (a zombie is not)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
