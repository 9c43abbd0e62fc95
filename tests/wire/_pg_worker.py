"""One rank of the process-group test: `python _pg_worker.py RANK PORT1 PORT2 [DEFAULT_GROUP_PORT]`.

With DEFAULT_GROUP_PORT the process first creates a default (gloo) group, as a torchrun trainer rank
has, and sets TORCHELASTIC_USE_AGENT_STORE like torchrun does. Prints one line "ok ..." on success.
"""

import os
import sys

import torch
import torch.distributed as dist

from dsv4rl.wire.process_group import (
    destroy_custom_process_group,
    format_init_method,
    init_custom_process_group,
)

rank, ports = int(sys.argv[1]), [int(sys.argv[2]), int(sys.argv[3])]
if len(sys.argv) > 4:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[4]}", rank=0, world_size=1)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"

for port in ports:  # the second time, the same group name again after destroy
    url = format_init_method("127.0.0.1", port)
    pg = init_custom_process_group("gloo", url, world_size=2, rank=rank, group_name="wug", timeout=20)
    floats = torch.arange(6, dtype=torch.float32).reshape(2, 3) if rank == 0 else torch.zeros(2, 3)
    ints = (
        torch.tensor([2**40 + 7, -3], dtype=torch.int64) if rank == 0 else torch.zeros(2, dtype=torch.int64)
    )
    dist.broadcast(floats, src=0, group=pg)
    dist.broadcast(ints, src=0, group=pg)
    assert floats.equal(torch.arange(6, dtype=torch.float32).reshape(2, 3)), floats
    assert ints.tolist() == [2**40 + 7, -3], ints
    destroy_custom_process_group(pg)
    del pg  # a shut-down gloo group still referenced at interpreter exit can abort the process

if dist.is_initialized():  # the default group is untouched and still works
    assert dist.get_world_size() == 1 and dist.get_rank() == 0
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
print("ok", rank)
