"""Rank 0 of a weight-update group, driven over stdin: `python _trainer_peer.py PORT GROUP TENSORS.pt`.

Commands (one per line): `send KEY` broadcasts each tensor of TENSORS[KEY] (a list of (name, tensor)),
`sendflat KEY` broadcasts them as one flattened uint8 buffer, `exit` destroys the group. Prints a line
after each command so the test can wait for it.
"""

import sys

import torch
import torch.distributed as dist

from dsv4rl.wire.layout import flatten_bucket
from dsv4rl.wire.process_group import (
    destroy_custom_process_group,
    init_custom_process_group,
    transport_view,
)

port, group, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
tensors = torch.load(path, weights_only=True)
pg = init_custom_process_group(
    "gloo", f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name=group, timeout=20
)
print("joined", flush=True)
for line in sys.stdin:
    command, *args = line.split()
    if command == "send":
        for _, tensor in tensors[args[0]]:
            dist.broadcast(transport_view(tensor.contiguous(), "gloo"), src=0, group=pg)
    elif command == "sendflat":
        dist.broadcast(flatten_bucket(tensors[args[0]]), src=0, group=pg)
    elif command == "exit":
        destroy_custom_process_group(pg)
        del pg  # see destroy_custom_process_group
        print("bye", flush=True)
        break
    print("done", command, flush=True)
