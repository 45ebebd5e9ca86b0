"""Fixtures for model tests: tiny random-weight checkpoints of each architecture, the
transformers oracle on the same weights, and runners built on the selected platform."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_cases import TINY_SPECS

from octavo.model_executor.batch_runner import RunnerConfig
from octavo.model_executor.model_config import ModelConfig
from octavo.model_executor.model_runner import ModelRunner
from octavo.testing.tiny_models import write_tiny_model


@pytest.fixture(autouse=True, scope="session")
def _tiny_shapes_on_one_thread(one_torch_thread):
    """Every test here runs on one torch thread (``one_torch_thread`` in tests/conftest.py)."""


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Architecture name -> folder of a float32 random-weight checkpoint."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: write_tiny_model(root / arch, spec) for arch, spec in TINY_SPECS.items()}


class TransformersOracle:
    """transformers on the same folder, EOS ignored; results memoised per session."""

    def __init__(self) -> None:
        self._models: dict = {}
        self._greedy: dict = {}

    def model(self, path: Path, dtype: torch.dtype):
        key = (str(path), dtype)
        if key not in self._models:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
            model.generation_config.eos_token_id = None
            model.config.eos_token_id = None
            self._models[key] = model
        return self._models[key]

    @torch.no_grad()
    def greedy(
        self, path: Path, prompt: list[int], max_new_tokens: int, dtype=torch.float32
    ) -> list[int]:
        key = (str(path), tuple(prompt), max_new_tokens, dtype)
        if key not in self._greedy:
            ids = torch.tensor([prompt])
            out = self.model(path, dtype).generate(
                ids, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
            )
            self._greedy[key] = out[0, len(prompt) :].tolist()
        return self._greedy[key]

    @torch.no_grad()
    def greedy_with_logits(
        self, path: Path, prompt: list[int], max_new_tokens: int, dtype=torch.float32
    ):
        """(tokens, per-step logits [max_new_tokens, V] in fp32) of transformers' greedy
        decoding."""
        out = self.model(path, dtype).generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()

    @torch.no_grad()
    def last_logits(self, path: Path, prompt: list[int], dtype=torch.float32) -> torch.Tensor:
        return self.model(path, dtype)(torch.tensor([prompt])).logits[0, -1].float()


@pytest.fixture(scope="session")
def oracle() -> TransformersOracle:
    return TransformersOracle()


@pytest.fixture(scope="session")
def make_runner(octavo_platform):
    """``make_runner(path, dtype=..., block_size=..., ...)`` -> a ModelRunner on the selected
    platform."""

    def make(
        path,
        *,
        dtype="float32",
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=None,
    ):
        config = ModelConfig.from_folder(
            path,
            dtype=dtype,
            supported_dtypes=octavo_platform.capabilities.dtypes,
            platform_name=octavo_platform.name,
            max_model_len=max_model_len,
        )
        return ModelRunner(
            config, octavo_platform, RunnerConfig(block_size, max_num_seqs, max_num_batched_tokens)
        )

    return make
