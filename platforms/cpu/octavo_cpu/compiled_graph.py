"""``--no-enforce-eager`` on the cpu platform: the model's forward as one torch.compile graph.

Inductor traces the whole forward (embedding, the decoder layers, the final norm) into one graph
with a dynamic token dimension. The compiled kernels (attention, GEMM, norms, rotary, SiLU) stay
opaque ops in it (their fake implementations are in :mod:`octavo_cpu.fake_ops`); what the graph
removes is the Python of ~100 module and op calls a step. Dynamo keys a graph on the number of
compute threads too, so steps run on one thread and steps run on all of them
(:mod:`octavo_cpu.threads`) each have their own graph, and single-token steps one more; the
runner's warm-up (:func:`octavo.model_executor.profile.warm_up`) compiles them at start-up, not
at the first requests.

Inductor keeps what it compiled on disk (``TORCHINDUCTOR_CACHE_DIR``), so a later start with the
same model and settings loads it instead of compiling again: ``--compile-cache-dir`` sets the
folder, else ``~/.cache/octavo/torch_compile`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.fx.experimental._config as fx_config

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/octavo/torch_compile")
logger = logging.getLogger(__name__)


def compile_cache_dir(requested: Optional[str]) -> Path:
    """Where inductor keeps its compiled graphs: ``requested``, else ``TORCHINDUCTOR_CACHE_DIR``,
    else :data:`DEFAULT_CACHE_DIR`."""
    if requested:
        return Path(requested).expanduser()
    from_env = os.environ.get(INDUCTOR_CACHE_ENV)
    return Path(from_env) if from_env else DEFAULT_CACHE_DIR.expanduser()


class CompiledForward:
    """The model's forward compiled by inductor; called as the model is, ``(input_ids,
    positions, attn_metadata) -> hidden_states``."""

    compiled = True

    def __init__(self, model: torch.nn.Module, cache_dir: Path):
        cache_dir.mkdir(parents=True, exist_ok=True)
        # Inductor reads its cache folder from this variable (and sets it itself when unset).
        os.environ[INDUCTOR_CACHE_ENV] = str(cache_dir)
        self.model = model
        self.cache_dir = cache_dir
        self._graph = torch.compile(model, dynamic=True, fullgraph=True)
        # Sizes of 1 stay symbolic, so one graph serves a batch of one token and of many (else a
        # decode step alone compiles a graph of its own), and sizes that happen to be equal are
        # not assumed to stay equal (two tokens against the two planes of a KV cache). Built
        # once: entering it costs microseconds.
        self._shape_config = fx_config.patch(backed_size_oblivious=True, use_duck_shape=False)
        logger.info("--no-enforce-eager: the forward is compiled by inductor (cache %s)", cache_dir)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any):
        if metadata.num_actual_tokens == input_ids.shape[0]:
            # "every token" as -1, so the graph reads the count from the token dimension instead
            # of specialising on a Python int that changes every step.
            metadata = dataclasses.replace(metadata, num_actual_tokens=-1)
        with self._shape_config:
            return self._graph(input_ids, positions, metadata)
