"""`dsv4rl eval`'s orchestration (`dsv4rl.launcher.eval_run`) without the CLI: the eval's run dir, the
earlier report removed before anything runs, and refusals named before the engines start."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from dsv4rl.config.compose import ConfigError
from dsv4rl.launcher.eval_run import eval_config, run_eval


def quiet() -> Console:
    return Console(file=io.StringIO())


def test_the_engines_run_gets_the_report_path_and_saved_responses_must_exist(tmp_path: Path) -> None:
    cfg = eval_config("tiny_arith", "tiny_arith", [f"run.dir={tmp_path}"], None, None, None, quiet())
    assert Path(cfg.run.dir) == tmp_path / "eval" / "tiny_arith"
    stale = Path(cfg.run.dir).resolve() / "eval.json"
    stale.parent.mkdir(parents=True)
    stale.write_text('{"pass@1": 0.0}')
    seen = []

    def run_task(run_cfg, path: Path) -> dict:
        seen.append((run_cfg, path, path.exists()))
        return {"pass@1": 1.0}

    report, path = run_eval(cfg, None, run_task)
    assert report == {"pass@1": 1.0} and path == stale
    assert seen == [(cfg, stale, False)]  # an earlier run's numbers are never shown as this run's

    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError, match=rf"^--responses {missing}: no such file$"):
        run_eval(cfg, str(missing), run_task)
    assert len(seen) == 1  # no engine starts for saved responses


def test_a_checkpoint_and_saved_responses_exclude_each_other(tmp_path: Path) -> None:
    """Refused right after composing: nothing is exported, no engine starts."""
    with pytest.raises(ConfigError, match="checkpoint= names the weights to score"):
        eval_config("tiny_arith", "tiny_arith", [], str(tmp_path / "run"), "saved.jsonl", None, quiet())
    assert not (tmp_path / "run").exists()
