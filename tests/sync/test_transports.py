"""The transports' seam with `WeightSync`: connect and close bracket what the buckets travel over."""

from __future__ import annotations

import torch

from dsv4rl.sync.loop_thread import LoopThread
from dsv4rl.sync.transports.broadcast import BroadcastTransport
from dsv4rl.sync.transports.tensor import TensorTransport


def test_closing_what_never_connected_does_nothing_twice() -> None:
    http = LoopThread()
    try:
        broadcast = BroadcastTransport(
            [], http, group_name="g", backend="gloo", master_address="127.0.0.1", master_port=1,
            engine_ranks=[], device=torch.device("cpu"), timeout_s=1,
        )  # fmt: skip
        assert broadcast.world_size == 1 and broadcast.group is None
        broadcast.close()
        broadcast.close()
        assert broadcast.group is None and broadcast.broken is None
        tensor = TensorTransport([], http, device=torch.device("cpu"), timeout_s=1)
        tensor.connect()  # nothing to join: colocated engines take handles over HTTP alone
        tensor.close()
        tensor.close()
        assert tensor.broken is None
    finally:
        http.stop()
