"""Fixtures shared by the platform test folders.

The cuda and rocm folders each name their platform (a ``platform_name`` fixture); their kernel
tests (marked ``needs_kernels``) run on that platform's GPU or in the Triton interpreter (the
``<name>-interpret`` CI legs: ``TRITON_INTERPRET=1``, the platform emulated on the CPU through
``OCTAVO_TRITON_INTERPRET_DEVICE=<name>``), and are skipped elsewhere.
"""

from __future__ import annotations

import importlib

import pytest

from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model
from octavo_triton import runtime

# Four prompts of 38, 6, 22 and 3 tokens: with 24 tokens a step, prefills are chunked and mixed
# with other requests' decodes in the same steps.
PROMPTS = [
    [1] + [(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((37, 5, 21, 2))
]
ENGINE_ARGS = dict(
    kv_cache_memory="2MiB", max_num_seqs=4, max_num_batched_tokens=24, dtype="float32"
)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "needs_kernels: runs Triton kernels (GPU or TRITON_INTERPRET=1)"
    )


def pytest_collection_modifyitems(config, items):
    """Skip ``needs_kernels`` tests of a platform folder without its GPU or the interpreter."""
    if runtime.interpreting():
        return
    usable = {}
    for item in items:
        name = item.path.parent.name
        if "needs_kernels" not in item.keywords or name not in ("cuda", "rocm"):
            continue
        if name not in usable:
            plugin = importlib.import_module(f"octavo_{name}.plugin").PLUGIN
            usable[name] = plugin.why_unavailable() is None
        if not usable[name]:
            reason = f"needs a {name} GPU or TRITON_INTERPRET=1 (the {name}-interpret leg)"
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def platform(platform_name):
    """The folder's platform, selected as ``--device NAME`` would (emulated under the
    interpreter)."""
    from octavo.platform import Platform

    with pytest.MonkeyPatch.context() as mp:
        if runtime.interpreting():
            mp.setenv(runtime.INTERPRET_DEVICE_ENV, platform_name)
        yield Platform.select(device=platform_name)


@pytest.fixture(scope="module")
def device(platform):
    """Where the kernels' tensors live: the GPU, or the CPU under the interpreter."""
    return platform.device_init(0)


@pytest.fixture
def greedy_tokens(tmp_path):
    """``greedy_tokens(device)``: the token ids ``LLM(tiny model, device=device)`` generates for
    ``PROMPTS`` greedily in float32, one list per prompt; the same model for every call."""
    from octavo import LLM, SamplingParams

    spec = TinyModelSpec(
        hidden_size=64, num_hidden_layers=2, vocab_size=512, max_position_embeddings=128, seed=7
    )
    model_dir = str(write_tiny_model(tmp_path / "llama", spec))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def generate(device: str) -> list[list[int]]:
        llm = LLM(model_dir, device=device, **ENGINE_ARGS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    return generate
