"""Metrics tailing and the live display's numbers."""

from __future__ import annotations

import io
import json

from rich.console import Console

from dsv4rl.launcher.progress import MetricsTail, RunProgress


def record(step: int, **extra) -> dict:
    base = {"step": step, "reward_mean": 0.5, "time_rollout_s": 2.0, "time_reward_s": 0.5}
    base |= {"time_train_s": 1.0, "time_sync_s": 0.5, "time_step_s": 5.0, "sync_bytes": 3 * 1024**2}
    return base | extra


def test_tail_reads_only_complete_new_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read_new() == []  # no file yet
    with path.open("w") as f:
        f.write(json.dumps({"step": 1}) + "\n" + '{"step": 2, "rew')
    assert tail.read_new() == [{"step": 1}]
    with path.open("a") as f:
        f.write('ard_mean": 1.0}\nnot json\n\n[1]\n')
    assert tail.read_new() == [{"step": 2, "reward_mean": 1.0}]
    assert tail.bad_lines == 1
    assert tail.read_new() == []
    assert not tail.rewritten


def test_tail_notices_a_rewritten_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    tail = MetricsTail(path)
    assert [r["step"] for r in tail.read_new()] == [1, 2, 3]
    path.write_text(json.dumps({"step": 1}) + "\n")  # resume from the step-1 checkpoint
    with path.open("a") as f:
        f.write(json.dumps({"step": 2, "reward_mean": 0.9}) + "\n" + json.dumps({"step": 3}) + "\n")
    assert tail.read_new() == [{"step": 1}, {"step": 2, "reward_mean": 0.9}, {"step": 3}]
    assert tail.rewritten
    with path.open("a") as f:
        f.write(json.dumps({"step": 4}) + "\n")
    assert tail.read_new() == [{"step": 4}] and not tail.rewritten


def test_a_tail_of_only_new_lines_never_returns_an_earlier_runs_steps(tmp_path):
    """The supervisor's tail: a resumed run's display and summary are its own steps. The trainer cuts the
    file back to the checkpoint's step and appends; the lines it kept are the earlier run's, and a run that
    fails before its first step has no step of its own at all."""
    path = tmp_path / "metrics.jsonl"
    earlier = [json.dumps(record(s, reward_mean=0.1 * s)) for s in (1, 2, 3)]
    path.write_text("".join(line + "\n" for line in earlier))
    tail = MetricsTail(path, only_new=True)
    assert tail.read_new() == []
    path.write_text(earlier[0] + "\n")  # resume from the step-1 checkpoint
    with path.open("a") as f:
        f.write(json.dumps(record(2, reward_mean=0.9)) + "\n")
    assert tail.read_new() == [record(2, reward_mean=0.9)]
    assert MetricsTail(tmp_path / "missing.jsonl", only_new=True).read_new() == []


def test_the_summary_of_a_resumed_run_shows_its_own_steps():
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=False, color_system=None)
    progress = RunProgress(total_steps=4)
    for step in (3, 4):
        progress.add(record(step, reward_mean=0.25 * step))
    console.print(progress.summary("/runs/x", "finished"))
    text = out.getvalue()
    assert "4 / 4 (steps 3-4 in this run: resumed)" in text and "final reward   1" in text
    assert "10.0 s" in text  # two steps of 5 s: this run's time only


def test_progress_totals_and_shares():
    progress = RunProgress(total_steps=10)
    progress.add(record(1))
    progress.add(record(2, reward_mean=0.75))
    assert progress.step == 2
    shares = progress.shares()
    assert shares == {"rollout": 4.0, "reward": 1.0, "train": 2.0, "sync": 1.0, "other": 2.0}
    assert progress.line(record(2)).startswith("step 2/10 | reward 0.5")
    assert "(rollout 40% reward 10% train 20% sync 10%)" in progress.line(record(2))
    assert progress.line(record(2)).endswith("| 5 s/step, ends in ~40 s")  # 8 steps left at 5 s


def test_the_line_shows_flat_groups_and_a_pace_that_follows_the_recent_steps():
    progress = RunProgress(total_steps=100)
    for step in range(1, 21):  # 10 steps of 5 s, then 10 of 0.5 s: the pace is the recent one
        progress.add(
            record(step, time_step_s=5.0 if step <= 10 else 0.5, **{"reward/zero_std_fraction": 1.0})
        )
    line = progress.line(progress.last)
    assert "| flat groups 1 |" in line and line.endswith("| 2 steps/s, ends in ~40 s")
    unplanned = RunProgress(total_steps=0)
    unplanned.add(record(1))
    assert unplanned.line(record(1)).endswith("| 5 s/step")  # no planned steps: no end


def test_live_renderable_and_summary_render():
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=True, color_system=None)
    progress = RunProgress(total_steps=4)
    console.print(progress.renderable())
    assert "waiting for step 1" in out.getvalue()
    progress.add(record(1))
    console.print(progress.renderable())
    console.print(progress.summary(tmp := "/runs/x", "finished"))
    text = out.getvalue()
    assert "1/4" in text and "3.0 MB" in text and "rollout" in text and "40%" in text
    assert "final reward" in text and tmp in text


def test_async_steps_count_rollout_as_background():
    """With async rollouts the batch was generated while the step before trained: shown, not summed."""
    progress = RunProgress(total_steps=4)
    progress.add(record(1, async_overlap_s=1.5, time_wait_rollout_s=0.5, time_verify_s=0.5))
    shares = progress.shares()
    assert shares["rollout (background)"] == 2.0 and shares["reward (background)"] == 0.5
    # step 5 s = wait 0.5 + train 1 + sync 0.5 + verify 0.5 + other 2.5
    assert shares["other"] == 2.5
    assert "rollout (background) 40%" in progress.line(progress.last)
