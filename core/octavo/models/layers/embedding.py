"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks."""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from octavo.models.layers.linear import TPGroup, check_shape


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split across ranks.

    The vocabulary is padded to a multiple of the TP size; rank ``r`` holds rows
    ``r * shard .. (r + 1) * shard``. Ids outside a rank's range embed to zero there and the
    partial results are all-reduced.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        dtype: torch.dtype,
        device: Union[str, torch.device],
        tp: TPGroup = TPGroup(),
    ):
        super().__init__()
        self.tp = tp
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.shard_rows = -(-num_embeddings // tp.size)
        self.vocab_start = tp.rank * self.shard_rows
        self.vocab_end = min(self.vocab_start + self.shard_rows, num_embeddings)
        weight = torch.empty(self.shard_rows, embedding_dim, dtype=dtype, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        """Load the full ``[vocab, dim]`` checkpoint tensor and keep this rank's rows."""
        assert shard_id is None
        check_shape(loaded, (self.num_embeddings, self.embedding_dim))
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = torch.where(outside, 0, input_ids - self.vocab_start)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.communicator.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to vocabulary logits, split by vocabulary rows like the embedding.

    ``tie_to(embedding)`` shares the embedding's weight (tied word embeddings).
    """

    widened_weight: Optional[torch.Tensor] = None
    packed: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # the platform's GEMM

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Use ``embedding``'s weight as this head's weight."""
        assert embedding.weight.shape == self.weight.shape
        self.weight = embedding.weight

    def widen(self) -> None:
        """Multiply in float32 from now on, over a float32 copy of the weight (the embedding
        may share the weight, so it keeps its dtype); see :mod:`octavo.models.layers.widen`."""
        self.widened_weight = self.weight.detach().float()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[S, hidden]`` -> logits ``[S, vocab]`` in the weight's dtype."""
        if self.packed is not None and self.widened_weight is not None:
            logits = self.packed(hidden_states.float()).to(self.weight.dtype)
        elif self.packed is not None:
            logits = self.packed(hidden_states)
        elif self.widened_weight is None:
            logits = F.linear(hidden_states, self.weight)
        else:
            logits = F.linear(hidden_states.float(), self.widened_weight).to(self.weight.dtype)
        if self.tp.size > 1:
            logits = self.tp.communicator.all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]
