"""The cpu platform's communicator (``octavo_communicator``: gloo) between two real processes:
all-reduce sums, all-gather concatenates in rank order, send/recv deliver."""

from __future__ import annotations

import subprocess
import sys

from tp_helpers import free_port

SCRIPT = r"""
import sys, datetime
import torch, torch.distributed as dist
from octavo.platform.facade import Platform

rank, port = int(sys.argv[1]), int(sys.argv[2])
platform = Platform.select("cpu")
assert platform.capabilities.dist_backend == "gloo"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
comm = platform.communicator(dist.group.WORLD)
x = torch.arange(6, dtype=torch.float32).view(2, 3) * (rank + 1)
total = comm.all_reduce(x.clone())
assert torch.equal(total, torch.arange(6, dtype=torch.float32).view(2, 3) * 3), total
gathered = comm.all_gather(torch.full((2, 2), float(rank)), dim=-1)
assert torch.equal(gathered, torch.tensor([[0.0, 0, 1, 1], [0, 0, 1, 1]])), gathered
if rank == 0:
    comm.send(torch.tensor([7, 8, 9]), dst=1)
else:
    got = comm.recv(torch.zeros(3, dtype=torch.int64), src=0)
    assert got.tolist() == [7, 8, 9], got
dist.barrier()
print("ok", rank, flush=True)
import os
os._exit(0)  # what is tested is above: gloo's teardown at exit can abort when a peer leaves first
"""


def test_cpu_communicator_collectives_between_two_processes(tmp_path):
    script = tmp_path / "collectives.py"
    script.write_text(SCRIPT)
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].decode() for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs
    assert [o.strip().splitlines()[-1] for o in outputs] == ["ok 0", "ok 1"]
