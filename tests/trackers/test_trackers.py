"""The trackers against their own readers: TensorBoard's event reader and the offline W&B run's records,
value for value; a failing tracker dropped with one notice; resume continuing the same tracker runs."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from tracker_readers import tensorboard_scalars, tensorboard_texts, wandb_config, wandb_history, wandb_summary

from dsv4rl.checks.validate import ConfigError, validate
from dsv4rl.config.choices import LoggerKind
from dsv4rl.config.compose import compose
from dsv4rl.trackers.hub import Trackers, open_trackers
from dsv4rl.trackers.outcome import record_outcome
from dsv4rl.trackers.state import STATE_FILE, TrackerState, read_state
from dsv4rl.trackers.wandb_log import has_credentials, offline_segments, sync_command, wandb_mode

ALL = "logger=[jsonl,tensorboard,wandb]"


def step_metrics(step: int, shift: float = 0.0) -> dict:
    # values no float32 holds exactly: a reader must give back the doubles metrics.jsonl has
    return {"step": step, "reward_mean": step / 7 + shift, "grad_norm": 1 / 3 + step, "sync_transport": "x",
            "eval/pass@1": 0.1 * step, "nonfinite_steps": 0, "missing": None}  # fmt: skip


def write_metrics(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_every_step_reads_back_equal_in_both_trackers(tmp_path: Path) -> None:
    cfg = compose("tiny_arith", [ALL, "tracker.wandb.tags=[demo]", "tracker.wandb.group=g"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    trackers = open_trackers(cfg, run_dir)
    assert trackers.names == ["tensorboard", "wandb"]
    rows = [step_metrics(step) for step in range(1, 6)]
    for row in rows:
        trackers.log_step(row["step"], row)
    trackers.close()
    write_metrics(run_dir, rows)
    state = read_state(run_dir)
    assert state.wandb_mode == "offline"

    scalars = tensorboard_scalars(run_dir / "tensorboard")
    history = wandb_history(run_dir, state.wandb_id)
    for row in rows:
        for key in ("reward_mean", "grad_norm", "eval/pass@1"):
            assert scalars[key][row["step"]] == row[key]  # exact: written as doubles
            assert history[row["step"]][key] == row[key]
        assert history[row["step"]]["sync_transport"] == "x"
    assert "sync_transport" not in scalars and "missing" not in scalars
    texts = tensorboard_texts(run_dir / "tensorboard")
    assert '"prompts_per_step": 32' in texts["config"][0] and "step_time" in texts["plan"][0]
    config = wandb_config(run_dir, state.wandb_id)
    assert config["algo"]["group_size"] == 16 and "memory" in config["plan"]

    lines = record_outcome(cfg, run_dir, "failed", "trainer: RuntimeError: boom")
    assert texts and any(sync_command(run_dir, state.wandb_id) in line for line in lines)
    assert tensorboard_texts(run_dir / "tensorboard")["outcome"] == ["failed: trainer: RuntimeError: boom"]
    summary = wandb_summary(run_dir, state.wandb_id)
    assert summary["outcome"] == "failed" and summary["root_cause"] == "trainer: RuntimeError: boom"
    assert summary["last_step"] == 5


def test_resume_continues_the_same_runs_from_the_checkpoint(tmp_path: Path) -> None:
    """Steps 1-4 logged, checkpoint at 2 (its tracker state kept), resume: steps 3-4 again, new values."""
    cfg = compose("tiny_arith", [ALL])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = open_trackers(cfg, run_dir)
    kept = None
    for step in range(1, 5):
        first.log_step(step, step_metrics(step))
        if step == 2:
            kept = first.state_dict()
    first.close()
    (run_dir / STATE_FILE).write_text("{}")  # the checkpoint's state is what counts
    second = open_trackers(cfg, run_dir, kept, resume_step=2)
    assert second.state.wandb_id == kept["wandb_id"]
    for step in (3, 4):
        second.log_step(step, step_metrics(step, shift=10.0))
    assert second.state_dict()["tensorboard_step"] == 4
    second.close()
    scalars = tensorboard_scalars(run_dir / "tensorboard")["reward_mean"]
    history = wandb_history(run_dir, kept["wandb_id"])
    assert len(offline_segments(run_dir, kept["wandb_id"])) == 2
    for step in range(1, 5):
        expected = step_metrics(step, shift=10.0 if step > 2 else 0.0)["reward_mean"]
        assert scalars[step] == expected
        assert history[step]["reward_mean"] == expected


class Broken:
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0
        self.closed = False

    def log_step(self, step: int, metrics: dict) -> None:
        self.calls += 1
        raise ConnectionError("no route to host")

    def close(self) -> None:
        self.closed = True


def test_a_failing_tracker_is_reported_once_and_dropped(tmp_path: Path, caplog) -> None:
    cfg = compose("tiny_arith", ["logger=[jsonl,tensorboard]"])
    trackers = open_trackers(cfg, tmp_path)
    broken = Broken()
    trackers = Trackers([broken, *trackers.trackers], trackers.state, tmp_path)
    with caplog.at_level(logging.WARNING):
        for step in range(1, 4):
            trackers.log_step(step, step_metrics(step))
    trackers.close()
    notices = [r.getMessage() for r in caplog.records if "broken tracker failed" in r.getMessage()]
    assert len(notices) == 1 and "ConnectionError: no route to host" in notices[0]
    assert broken.calls == 1 and broken.closed
    assert sorted(tensorboard_scalars(tmp_path / "tensorboard")["reward_mean"]) == [1, 2, 3]


def test_a_tracker_that_cannot_start_leaves_the_others(tmp_path: Path, monkeypatch, caplog) -> None:
    import dsv4rl.trackers.wandb_log as wandb_log

    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(wandb_log.WandbTracker, "__init__", refuse)
    with caplog.at_level(logging.WARNING):
        trackers = open_trackers(compose("tiny_arith", [ALL]), tmp_path)
    assert trackers.names == ["tensorboard"]
    assert any("wandb tracker could not start" in r.getMessage() for r in caplog.records)
    trackers.close()


def test_jsonl_only_opens_nothing(tmp_path: Path) -> None:
    cfg = compose("tiny_arith", [])
    assert cfg.logger == [LoggerKind.jsonl]
    assert open_trackers(cfg, tmp_path).names == []
    assert not (tmp_path / STATE_FILE).exists()
    assert record_outcome(cfg, tmp_path, "finished", None) == []


def test_logger_list_is_checked() -> None:
    with pytest.raises(ConfigError, match="lacks jsonl"):
        validate(compose("tiny_arith", ["logger=[tensorboard]"]), check_paths=False)
    with pytest.raises(ConfigError, match="more than once"):
        validate(compose("tiny_arith", ["logger=[jsonl,wandb,wandb]"]), check_paths=False)
    with pytest.raises(ConfigError, match="tracker.wandb.project"):
        validate(compose("tiny_arith", [ALL, "tracker.wandb.project="]), check_paths=False)
    with pytest.raises(ConfigError, match="logger does not list wandb"):
        validate(compose("tiny_arith", ["tracker.wandb.project=x"]), check_paths=False)
    with pytest.raises(ConfigError, match="logger"):
        compose("tiny_arith", ["logger=[jsonl,mlflow]"])


def test_wandb_goes_online_only_with_credentials(tmp_path: Path) -> None:
    assert not has_credentials({"NETRC": str(tmp_path / "none")})
    assert wandb_mode({"NETRC": str(tmp_path / "none")}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode({"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}) == "offline"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    netrc.chmod(0o600)
    assert has_credentials({"NETRC": str(netrc)})
    assert not has_credentials({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.com"})


def test_state_round_trip(tmp_path: Path) -> None:
    state = TrackerState(wandb_id="abc", wandb_mode="offline", tensorboard_step=7)
    assert TrackerState.from_dict(state.to_dict()) == state
    assert read_state(tmp_path) is None
