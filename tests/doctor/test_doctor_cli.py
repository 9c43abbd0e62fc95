"""`dsv4rl doctor` on the command line: JSON shape, exit codes, recipe handling, and a real run here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import dsv4rl.doctor.probe
from dsv4rl.cli import app
from dsv4rl.doctor.probe import RecordedProbe

runner = CliRunner()
STATES = Path(__file__).parent / "states"
DSV4RL = Path(sys.executable).parent / "dsv4rl"


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch):
    """Make the CLI's SystemProbe read a recorded state."""

    def use(name: str) -> None:
        monkeypatch.setattr(
            dsv4rl.doctor.probe, "SystemProbe", lambda: RecordedProbe.load(STATES / f"{name}.json")
        )

    return use


def test_json_has_exactly_checks_and_summary(node) -> None:
    node("mi355x_reference")
    result = runner.invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) == {"checks", "summary"}
    assert all(set(c) == {"name", "status", "detail", "remedy"} for c in report["checks"])
    summary = report["summary"]
    assert summary["FAIL"] == 0 and summary["hostname"] == "mi355x-node2" and summary["recipe"] is None
    assert summary["PASS"] + summary["WARN"] + summary["SKIP"] == len(report["checks"])


def test_a_fail_exits_1_and_the_table_names_it(node) -> None:
    node("mi300x_planted")
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 1
    assert "env.visible_devices" in result.output and "FAIL" in result.output


def test_recipe_and_overrides_reach_the_checks(node) -> None:
    node("cpu_only")
    result = runner.invoke(app, ["doctor", "recipe=tiny_arith", "run.dir=/home/user/runs/t", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["summary"]["recipe"] == "tiny_arith"
    run_dir = next(c for c in report["checks"] if c["name"] == "storage.run_dir")
    assert "run.dir=/home/user/runs/t" in run_dir["detail"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["algo.group_size=4"], "overrides without a recipe"),
        (["recipe=no_such_recipe"], "unknown recipe"),
        (["recipe=tiny_arith", "algo.group_sise=4"], "group_sise"),
        (["recipe=tiny_arith", "recipe=dapo_math"], "given 2 times"),
    ],
)
def test_bad_recipe_or_overrides_exit_2(node, args: list[str], message: str) -> None:
    node("cpu_only")
    result = runner.invoke(app, ["doctor", *args])
    assert result.exit_code == 2
    assert message in result.output and "error:" in result.output


def test_probe_adds_the_bandwidth_rows(node) -> None:
    node("h100")
    result = runner.invoke(app, ["doctor", "--json", "--probe"])
    names = [c["name"] for c in json.loads(result.stdout)["checks"]]
    assert names[-2:] == ["probe.all_reduce", "probe.broadcast"]


def test_real_run_on_this_machine_is_valid_json_and_quick() -> None:
    env = {k: v for k, v in os.environ.items() if not k.endswith("VISIBLE_DEVICES")}
    start = time.monotonic()
    done = subprocess.run(
        [str(DSV4RL), "doctor", "--json"], capture_output=True, text=True, timeout=120, env=env
    )
    seconds = time.monotonic() - start
    print(f"`dsv4rl doctor --json` took {seconds:.2f} s here")
    assert done.returncode in (0, 1), done.stderr
    report = json.loads(done.stdout)
    assert (report["summary"]["FAIL"] > 0) == (done.returncode == 1) == (report["summary"]["exit_code"] == 1)
    assert seconds < 20
    if shutil.which("rocminfo") is None and shutil.which("nvidia-smi") is None:
        gpu = next(c for c in report["checks"] if c["name"] == "gpu.devices")
        assert gpu["detail"].startswith("no GPU on this machine")
        assert report["summary"]["gpus"] == "none (no GPU on this machine)"
