"""The cpu platform's communicator (``octavo_communicator``) between two real processes, through
shared memory (ranks on one host) and through gloo (``OCTAVO_CPU_SHM=0``): all-reduce sums
(a tensor larger than a shared-memory slot too, and many in a row), all-gather concatenates in
rank order, send/recv deliver."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
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
print(type(comm).__name__)
x = torch.arange(6, dtype=torch.float32).view(2, 3) * (rank + 1)
total = comm.all_reduce(x.clone())
assert torch.equal(total, torch.arange(6, dtype=torch.float32).view(2, 3) * 3), total
for step in range(200):  # both buffers, reused over and over, in bf16 and float32
    dtype = torch.bfloat16 if step % 3 else torch.float32
    y = torch.full((step % 7 + 1, 5), float(step + rank), dtype=dtype)
    assert torch.equal(comm.all_reduce(y), torch.full_like(y, float(2 * step + 1))), step
big = torch.full((3 << 20,), float(rank + 1))  # 12 MiB: larger than a slot
assert torch.equal(comm.all_reduce(big), torch.full_like(big, 3.0))
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


@pytest.mark.parametrize(
    "shm, kind",
    [
        pytest.param(
            "1",
            "SharedMemoryCommunicator",
            marks=pytest.mark.skipif(
                platform.machine() not in ("x86_64", "AMD64"), reason="x86 only"
            ),
        ),
        ("0", "TorchDistributedCommunicator"),
    ],
    ids=["shared-memory", "gloo"],
)
def test_cpu_communicator_collectives_between_two_processes(tmp_path, shm, kind):
    script = tmp_path / "collectives.py"
    script.write_text(SCRIPT)
    port = str(free_port())
    env = {**os.environ, "OCTAVO_CPU_SHM": shm}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].decode() for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs
    assert [o.strip().splitlines()[-1] for o in outputs] == ["ok 0", "ok 1"]
    assert all(o.strip().splitlines()[0] == kind for o in outputs), outputs
