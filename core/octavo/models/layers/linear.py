"""Linear layers written for tensor parallelism: column- and row-parallel, with per-parameter
loaders.

Each parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)`` that takes a
checkpoint tensor (a ``torch.Tensor`` or a lazy :class:`octavo.models.weights.CheckpointTensor`,
which reads from the file only the slice asked for), checks its shape, and copies in this rank's
slice. With ``TPGroup()`` (size 1) every slice is the whole tensor.

A layer multiplies with ``F.linear`` unless a quantisation method was attached after loading
(``layer.quant_method``, see :mod:`octavo.models.layers.fp8`): then every product goes through
``quant_method.apply(layer, x, start, size, bias)`` over the weight rows ``start:start+size``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from octavo.platform.types import Communicator


@dataclasses.dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group; ``communicator`` is needed when size > 1."""

    size: int = 1
    rank: int = 0
    communicator: Optional[Communicator] = None

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size
        if self.size > 1 and self.communicator is None:
            raise ValueError("tensor parallelism with size > 1 needs a communicator")

    def split(self, size: int, what: str) -> int:
        """This rank's share of ``size`` (which must divide evenly)."""
        if size % self.size:
            raise ValueError(
                f"{what} ({size}) is not divisible by the tensor-parallel size ({self.size})"
            )
        return size // self.size

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """``(first, count)``: the KV heads this rank holds. A share of them when they divide
        evenly; when the ranks outnumber them (``size`` a multiple of ``num_kv_heads``), the one
        head this rank's query heads attend with, replicated across ``size // num_kv_heads``
        ranks."""
        if num_kv_heads >= self.size:
            count = self.split(num_kv_heads, "num_key_value_heads")
            return self.rank * count, count
        if self.size % num_kv_heads:
            raise ValueError(
                f"the tensor-parallel size ({self.size}) is neither a divisor nor a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        return self.rank * num_kv_heads // self.size, 1


def materialize(loaded) -> torch.Tensor:
    """The whole tensor of a checkpoint tensor (read now when it is a lazy one)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.narrow(0, 0, loaded.shape[0])


def check_shape(loaded: torch.Tensor, expected: Sequence[int]) -> None:
    """Raise ValueError when a checkpoint tensor does not have the shape the config implies."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"has shape {list(loaded.shape)} but the model config implies {list(expected)}"
        )


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy a replicated tensor whole (norm weights and the like)."""
    assert shard_id is None
    check_shape(loaded, param.shape)
    param.data.copy_(materialize(loaded))


def _parameter(shape, dtype, device, loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader
    return param


class QuantMethod(Protocol):
    """A quantised matmul a linear layer delegates to once its weight was quantised."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, start: int, size: int, bias: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """``x @ W[start:start+size]^T (+ bias)`` in ``x``'s dtype, from the layer's own tensors."""
        ...


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s output rows split across ranks; the output stays split.

    ``shards`` gives each output part's ``(first row, rows)`` on this rank; by default rank ``r``
    holds the ``r``-th of ``size`` equal shares of every part.
    """

    quant_method: Optional[QuantMethod] = None

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        *,
        dtype: torch.dtype,
        device: Union[str, torch.device],
        tp: TPGroup = TPGroup(),
        shards: Optional[Sequence[tuple[int, int]]] = None,
    ):
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_sizes = tuple(output_sizes)
        if shards is None:
            rows = [tp.split(n, "linear output size") for n in self.output_sizes]
            shards = [(tp.rank * n, n) for n in rows]
        self.shard_starts = tuple(start for start, _ in shards)
        self.shard_sizes = tuple(size for _, size in shards)
        self.shard_offsets = tuple(sum(self.shard_sizes[:i]) for i in range(len(self.shard_sizes)))
        out = sum(self.shard_sizes)
        self.weight = _parameter((out, input_size), dtype, device, self.weight_loader)
        self.bias = _parameter((out,), dtype, device, self.weight_loader) if bias else None

    def _shard_index(self, shard_id) -> int:
        return 0 if shard_id is None else int(shard_id)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        """Load the full checkpoint tensor of output part ``shard_id`` and keep this rank's rows."""
        index = self._shard_index(shard_id)
        full_rows, rows = self.output_sizes[index], self.shard_sizes[index]
        check_shape(loaded, (full_rows, *param.shape[1:]))
        mine = loaded.narrow(0, self.shard_starts[index], rows)
        param.data.narrow(0, self.shard_offsets[index], rows).copy_(mine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, 0, self.weight.shape[0], self.bias)
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input held in one weight (e.g. gate and up).

    Checkpoint tensors load with ``shard_id`` = their index in ``output_sizes``.
    """

    def forward_parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each projection by its own matmul over its rows of the weight: the outputs come out
        contiguous, and on CPU (MKL) two ``[n, k]`` products beat one ``[2n, k]`` by 5-15%."""
        outs = []
        for offset, size in zip(self.shard_offsets, self.shard_sizes):
            bias = None if self.bias is None else self.bias[offset : offset + size]
            if self.quant_method is not None:
                outs.append(self.quant_method.apply(self, x, offset, size, bias))
            else:
                outs.append(F.linear(x, self.weight[offset : offset + size], bias))
        return outs


class QKVParallelLinear(ColumnParallelLinear):
    """The fused query/key/value projection; checkpoint tensors load with shard ids q, k, v.

    Query heads split evenly across ranks; KV heads as :meth:`TPGroup.kv_heads` says (split, or
    replicated when the ranks outnumber them)."""

    SHARD_IDS = {"q": 0, "k": 1, "v": 2}

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        *,
        dtype: torch.dtype,
        device: Union[str, torch.device],
        tp: TPGroup = TPGroup(),
    ):
        sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        q_rows = tp.split(num_heads, "num_attention_heads") * head_dim
        first_kv, kv_count = tp.kv_heads(num_kv_heads)
        kv_shard = (first_kv * head_dim, kv_count * head_dim)
        shards = ((tp.rank * q_rows, q_rows), kv_shard, kv_shard)
        super().__init__(hidden_size, sizes, bias, dtype=dtype, device=device, tp=tp, shards=shards)
        self.q_size, self.kv_size = self.shard_sizes[0], self.shard_sizes[1]

    def _shard_index(self, shard_id) -> int:
        return self.SHARD_IDS[shard_id]

    def split_qkv(self, qkv: torch.Tensor):
        """``[T, q+k+v]`` -> the three views ``q [T, q]``, ``k [T, kv]``, ``v [T, kv]``."""
        return qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s input columns split across ranks; partial outputs are
    all-reduced, and the bias is added once, after the reduction."""

    quant_method: Optional[QuantMethod] = None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        *,
        dtype: torch.dtype,
        device: Union[str, torch.device],
        tp: TPGroup = TPGroup(),
    ):
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        self.input_shard = tp.split(input_size, "linear input size")
        self.weight = _parameter((output_size, self.input_shard), dtype, device, self.weight_loader)
        self.bias = (
            _parameter((output_size,), dtype, device, default_weight_loader) if bias else None
        )

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        """Load the full checkpoint weight and keep this rank's input columns."""
        assert shard_id is None
        check_shape(loaded, (self.output_size, self.input_size))
        param.data.copy_(loaded.narrow(1, self.tp.rank * self.input_shard, self.input_shard))

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, 0, self.output_size, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._linear(x, self.bias)
        out = self.tp.communicator.all_reduce(self._linear(x, None))
        return out if self.bias is None else out + self.bias
