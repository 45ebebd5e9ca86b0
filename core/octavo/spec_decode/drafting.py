"""What the proposers that run a model of their own share (a draft model, an EAGLE head): a
one-token decode's attention metadata on the target's block table, drafts sampled from the
drafter's distribution under each request's own sampling settings, and those distributions
kept for the verifier's accept test."""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np
import torch

from octavo.model_executor.model_config import ModelConfig
from octavo.model_executor.step_inputs import ragged_index
from octavo.ops import reference
from octavo.platform.types import AttentionMetadata, SamplerFn, SamplingMetadata
from octavo.spec_decode.verifier import target_distribution


class DraftDistributions:
    """Drafts sampled from a drafter's logits, and their distributions until verification.

    Greedy drafts are the platform sampler's (``sampler``, the runner's) for all-greedy rows:
    its argmax, the one decoding takes (the cpu platform's compiled one costs ~8 us on a
    batch-1 step's few rows of the demo model's logits, torch's ~55)."""

    def __init__(self, vocab_size: int, k: int, device: torch.device, sampler: SamplerFn):
        self.vocab_size, self.k, self.device = vocab_size, k, device
        self.sampler = sampler
        self._probs: dict[str, torch.Tensor] = {}  # req id -> [k, V] probs of its drafts

    def argmax(self, logits: torch.Tensor) -> np.ndarray:
        """Each row's argmax (greedy drafts), on the host."""
        metadata = greedy_metadata(logits.shape[0], self.device)
        return self.sampler(logits, metadata).cpu().numpy()

    def new_probs(self, batch: Any, rows: np.ndarray) -> Optional[torch.Tensor]:
        """``[len(rows), K, V]`` zeros to fill, or None when every row is greedy."""
        if not batch.temperature[rows].any():
            return None
        return torch.zeros(len(rows), self.k, self.vocab_size, device=self.device)

    def sample(self, logits: torch.Tensor, batch: Any, rows: np.ndarray) -> tuple[np.ndarray, Any]:
        """``(drafts, probs)`` for the batch rows ``rows`` from ``logits`` (after the requests'
        logits processors): greedy rows take the argmax (probs 0), the others sample the
        drafter's distribution under their temperature, top-k, top-p and min-p. Where every row
        is greedy no sampling tensors are built (an EAGLE-family proposer samples each draft
        depth apart: five builds a batch-1 verify step at K = 4)."""
        if not batch.temperature[rows].any():
            return self.argmax(logits), 0.0
        metadata = batch.sampling_metadata(rows)
        every_row = torch.arange(logits.shape[0], device=logits.device)
        q = target_distribution(logits, metadata, every_row)
        noise = reference.exponential_noise(q.shape, metadata, logits.device)
        temperature = metadata.temperature
        sampled = torch.where(temperature > 0, (q / noise).argmax(dim=-1), logits.argmax(dim=-1))
        q = torch.where((temperature > 0).unsqueeze(1), q, 0.0)
        return sampled.cpu().numpy(), q

    def keep(self, batch: Any, rows: np.ndarray, num_drafts: np.ndarray, probs) -> None:
        if probs is None:
            return
        req_ids = batch.req_ids
        for i in np.flatnonzero(num_drafts).tolist():
            self._probs[req_ids[rows[i]]] = probs[i]

    def draft_probs(
        self, batch: Any, rows: np.ndarray, num_drafts: np.ndarray
    ) -> Optional[torch.Tensor]:
        """``[sum(num_drafts), V]`` the probabilities ``rows``' drafts were drawn from (zeros for
        greedy requests, whose verification reads none); None when every request is greedy."""
        req_ids = batch.req_ids
        kept = [
            (self._probs.pop(req_ids[row], None), k)
            for row, k in zip(rows.tolist(), num_drafts.tolist())
        ]
        if all(probs is None or not k for probs, k in kept):
            return None
        return torch.cat(
            [
                torch.zeros(k, self.vocab_size, device=self.device) if probs is None else probs[:k]
                for probs, k in kept
                if k
            ]
        )

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self._probs.pop(req_id, None)


@functools.lru_cache(maxsize=64)
def greedy_metadata(num_rows: int, device) -> SamplingMetadata:
    """Sampling metadata of ``num_rows`` greedy rows, made once per row count and shared (no
    sampler writes its metadata)."""
    return SamplingMetadata(
        temperature=torch.zeros(num_rows, dtype=torch.float32, device=device),
        top_k=torch.zeros(num_rows, dtype=torch.int32, device=device),
        top_p=torch.ones(num_rows, dtype=torch.float32, device=device),
        min_p=torch.zeros(num_rows, dtype=torch.float32, device=device),
        all_greedy=True,
    )


def decode_metadata(
    batch: Any, rows: np.ndarray, positions: np.ndarray, block_size: int, device
) -> AttentionMetadata:
    """Attention metadata of one token per row of ``rows`` at ``positions``, its KV written to
    the position's slot in the row's blocks."""
    return chunk_metadata(batch, rows, positions, np.ones(len(rows), np.int64), block_size, device)


def chunk_metadata(
    batch: Any,
    rows: np.ndarray,
    first: np.ndarray,
    counts: np.ndarray,
    block_size: int,
    device,
    layout: Optional[tuple[np.ndarray, np.ndarray]] = None,
) -> AttentionMetadata:
    """Attention metadata of ``counts[i]`` consecutive tokens from position ``first[i]`` for
    each row of ``rows``, their KV written to the positions' slots in the row's blocks;
    ``layout`` is ``chunk_layout(first, counts)`` where the caller has it."""
    row, positions = layout if layout is not None else chunk_layout(first, counts)
    seq_lens = first + counts
    max_seq_len = int(seq_lens.max())
    block_table = batch.block_table[rows, : -(-max_seq_len // block_size)]
    slots = block_table[row, positions // block_size].astype(np.int64) * block_size
    query_start_loc = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=query_start_loc[1:])
    return AttentionMetadata(
        query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_table=torch.from_numpy(np.ascontiguousarray(block_table)).to(device),
        slot_mapping=torch.from_numpy(slots + positions % block_size).to(device),
        max_query_len=int(counts.max()),
        max_seq_len=max_seq_len,
        num_actual_tokens=len(positions),
        num_context_tokens=int(seq_lens.sum()),
    )


def chunk_layout(first: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(row, position)`` of each token of a chunk of ``counts[i]`` consecutive positions from
    ``first[i]`` for each row ``i``, flat in row order."""
    row, offset = ragged_index(counts)
    return row, first[row] + offset


def drafter_config(folder: str, runner: Any) -> ModelConfig:
    """The config of the drafter in ``folder``, in the target's dtype and context."""
    target = runner.model_config
    return ModelConfig.from_folder(
        folder,
        dtype=target.dtype,
        supported_dtypes=runner.platform.capabilities.dtypes,
        platform_name=runner.platform.name,
        max_model_len=target.max_model_len,
    )
