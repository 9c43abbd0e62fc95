"""Two trainer ranks as two pipeline stages, each sending half of a model over its own group.

Usage (under torchrun, 2 processes, gloo): _staged_trainer.py OUT PORT0 PORT1 URL [URL ...] [--bad-stage-1]
Rank r sends the r-th half of `trainer_model(TRAINER_SEED + 5)`'s tensors through `StagedWeightSync`.
`--bad-stage-1`: stage 1 also sends a tensor no engine holds, so its bucket is refused.
Rank 0 writes OUT/stats.json; a rank whose push raised writes OUT/error-rank<r>.txt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from sync_helpers import TRAINER_SEED, trainer_model

from dsv4rl.config.schema import SyncConfig
from dsv4rl.engine_client.client import EngineClient
from dsv4rl.sync.stages import StagedWeightSync
from dsv4rl.sync.weight_sync import WeightSync, WeightSyncError
from dsv4rl.topology import SyncSource, stage_group_name

GROUP = "staged_test_group"


def main() -> None:
    out, ports = Path(sys.argv[1]), [int(sys.argv[2]), int(sys.argv[3])]
    urls = [a for a in sys.argv[4:] if a.startswith("http")]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sources = [
        SyncSource(stage, stage, 0, "127.0.0.1", ports[stage], stage_group_name(GROUP, stage))
        for stage in (0, 1)
    ]
    tensors = list(trainer_model(TRAINER_SEED + 5).state_dict().items())
    half = len(tensors) // 2
    mine = tensors[:half] if rank == 0 else tensors[half:]
    if rank == 1 and "--bad-stage-1" in sys.argv:
        mine.append(("model.layers.0.not_a_tensor.weight", torch.zeros(4)))
    cfg = SyncConfig(bucket_bytes=64 * 1024, group_name=GROUP, timeout_s=60.0)
    sender = WeightSync(
        [EngineClient(url, timeout_s=60) for url in urls],
        cfg,
        "gloo",
        "127.0.0.1",
        ports[rank],
        group_name=sources[rank].group_name,
    )
    staged = StagedWeightSync(sources, rank, sender)
    try:
        staged.connect()
        staged.share_wire_format(lambda: None)
        stats = staged.push(iter(mine), "v-staged", record_checksums=True)
        if rank == 0:
            fields = ("bytes", "buckets", "tensors", "sources", "checksums", "transfer_seconds")
            (out / "stats.json").write_text(json.dumps({f: getattr(stats, f) for f in fields}))
        else:
            assert stats is None
    except WeightSyncError as exc:
        (out / f"error-rank{rank}.txt").write_text(str(exc))
    finally:
        staged.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
