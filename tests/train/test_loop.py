"""The pure parts of the RL loop (the loop itself runs end to end in tests/e2e)."""

from __future__ import annotations

from pathlib import Path

import torch

from dsv4rl.config.schema import Config


def test_sync_weights_verifies_when_due_and_stops_on_a_failed_check(monkeypatch) -> None:
    """RLLoop.sync_weights: the first sync and every `every_steps`-th are checked; a failure propagates."""
    from types import SimpleNamespace

    import pytest

    import dsv4rl.train.loop as loop_module
    from dsv4rl.sync.verify import SyncVerificationError
    from dsv4rl.sync.weight_sync import SyncStats
    from dsv4rl.train.loop import RLLoop

    monkeypatch.setattr(loop_module.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(loop_module.dist, "get_world_size", lambda: 1)
    calls: list[tuple] = []

    class Engine:
        device = torch.device("cpu")

        def local_weights(self):
            yield "embed.weight", torch.ones(2)

        def named_weights_for_sync(self, by_stage=False):
            calls.append(("export", by_stage))
            yield "embed.weight", torch.ones(2)

        def compute_logprobs(self, ids, temperature=1.0):
            calls.append(("trainer_forward", tuple(ids.shape), temperature))
            return torch.zeros(ids.shape[0], ids.shape[1] - 1)

    class Sync:
        by_stage = False

        def push(self, named, version, record_checksums):
            list(named)
            calls.append(("push", version, record_checksums))
            return SyncStats(
                bytes=8, seconds=1.0, checksums={"embed.weight": "x"} if record_checksums else {}
            )

    class Verifier:
        fail = False

        def check_checksums(self, sent, step):
            calls.append(("checksums", step, dict(sent)))
            return {"verify_checksum_tensors": 1.0}

        def check_probe(self, probe, trainer, step):
            calls.append(("probe", step))
            if self.fail:
                raise SyncVerificationError(f"weight sync of step {step} failed the log-prob probe")
            return {"verify_probe_abs_diff": 0.0}

    cfg = Config()
    cfg.sync.verify.checksum, cfg.sync.verify.logprob_probe, cfg.sync.verify.every_steps = True, True, 3
    verifier = Verifier()
    driver = SimpleNamespace(verifier=verifier, colocated=None, roster=None)
    probe = torch.zeros(2, 5, dtype=torch.long)
    loop = RLLoop(cfg, Engine(), Path("unused"), driver=driver, weight_sync=Sync(), probe=probe)
    stats, metrics = loop.sync_weights(version=1)  # the first sync of the process: checked
    assert stats.bytes == 8 and metrics == {"verify_checksum_tensors": 1.0, "verify_probe_abs_diff": 0.0}
    assert calls == [
        ("export", False),
        ("push", "1", True),
        ("checksums", 1, {"embed.weight": "x"}),
        ("trainer_forward", (2, 5), 1.0),
        ("probe", 1),
    ]
    calls.clear()
    assert loop.sync_weights(version=2)[1] == {}  # not due
    assert calls == [("export", False), ("push", "2", False)]
    verifier.fail = True
    with pytest.raises(SyncVerificationError, match="step 3"):
        loop.sync_weights(version=3)
