"""The parallel layout: how many tensor-parallel ranks, on how many nodes, meeting where.

Ranks are numbered node by node: node ``n`` of ``nnodes`` runs ranks
``n * ranks_per_node .. (n + 1) * ranks_per_node - 1``; rank 0 (on node 0) drives the others.
The rendezvous is torch.distributed's TCP store at ``master_addr:master_port`` (the flags, else
the standard ``MASTER_ADDR`` / ``MASTER_PORT`` environment variables; ``NNODES`` and
``NODE_RANK`` likewise).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
from typing import Optional

from octavo.errors import ConfigError

DEFAULT_MASTER_ADDR = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """``master_port`` None: a free port is picked (one node only)."""

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: Optional[int] = None

    @classmethod
    def from_args(cls, args) -> "ParallelConfig":
        """The layout an ``EngineArgs`` asks for, the environment filling what it leaves unset
        (``NNODES`` and ``NODE_RANK`` only when it asks for more than one rank: a one-rank
        engine started inside some other job's environment is still one rank)."""
        env = os.environ
        sharded = args.tensor_parallel_size > 1
        return cls(
            tensor_parallel_size=args.tensor_parallel_size,
            nnodes=args.nnodes if args.nnodes is not None else _env_int("NNODES", 1, sharded),
            node_rank=args.node_rank
            if args.node_rank is not None
            else _env_int("NODE_RANK", 0, sharded),
            master_addr=args.master_addr or env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
            master_port=args.master_port
            if args.master_port is not None
            else _env_int("MASTER_PORT", None, sharded),
        ).validated()

    def validated(self) -> "ParallelConfig":
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        if not isinstance(nnodes, int) or nnodes < 1:
            raise ConfigError(f"nnodes must be a positive integer; got {nnodes!r}")
        if not 0 <= self.node_rank < nnodes:
            raise ConfigError(f"node_rank must be in [0, {nnodes - 1}]; got {self.node_rank!r}")
        if tp % nnodes:
            raise ConfigError(
                f"tensor_parallel_size {tp} does not split evenly over {nnodes} nodes: give a "
                "multiple of --nnodes (each node runs the same number of ranks)"
            )
        port = self.master_port
        if port is not None and not 0 < port < 65536:
            raise ConfigError(f"master_port must be in [1, 65535]; got {port!r}")
        if nnodes > 1 and port is None:
            raise ConfigError(
                "a multi-node run needs a rendezvous port every node agrees on: pass "
                "--master-port (or set MASTER_PORT) on every node"
            )
        return self

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The ranks this node runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    @property
    def init_method(self) -> str:
        assert self.master_port is not None, "resolve the port first (with_rendezvous_port)"
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"

    def with_rendezvous_port(self) -> "ParallelConfig":
        """This config with its port resolved: on node 0, a free one picked or the one given
        checked free (rank 0 listens there); other nodes connect to it as given."""
        if self.node_rank != 0:
            return self
        if self.master_port is None:
            with socket.socket() as probe:
                probe.bind(("", 0))
                return dataclasses.replace(self, master_port=probe.getsockname()[1])
        with socket.socket() as probe:
            try:
                probe.bind(("", self.master_port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                raise ConfigError(
                    f"the rendezvous port {self.master_port} is in use on this host (another "
                    "octavo or torch.distributed job?): pass a free --master-port or set "
                    "MASTER_PORT"
                ) from None
        return self


def _env_int(name: str, default: Optional[int], read: bool = True) -> Optional[int]:
    raw = os.environ.get(name) if read else None
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} must be an integer") from None


def check_shardable(model_config, tensor_parallel_size: int) -> None:
    """Raise ConfigError when the model's shapes cannot be split across the ranks."""
    tp, mc = tensor_parallel_size, model_config
    fix = f"choose a --tensor-parallel-size that divides it (got {tp})"
    for name in ("num_attention_heads", "intermediate_size"):
        value = getattr(mc, name)
        if value % tp:
            raise ConfigError(f"the model's {name} ({value}) is not divisible by {tp}: {fix}")
    kv = mc.num_key_value_heads
    if kv % tp and tp % kv:
        raise ConfigError(
            f"the model's num_key_value_heads ({kv}) neither divides by nor divides the "
            f"tensor-parallel size {tp}: give a divisor of {kv} or a multiple of it (KV heads "
            "are then replicated)"
        )
