"""`dsv4rl eval`: the eval's config (a recipe's model, or a run's checkpoint exported once) and its run
(saved responses graded here, or the engines started under the node supervisor with the eval worker).

It lives on the launcher's floor, not in `dsv4rl.eval`, because it exports checkpoints, validates the
recipe and starts processes; the grading and scoring it calls are `dsv4rl.eval`'s. Every refusal is a
`ValueError` (`ConfigError`, `ExportError`, `EvalDataError`, `ResponsesError`) whose message names the
problem and the fix; the command prints it and exits 2.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from dsv4rl.checks.validate import validate
from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.config.schema import Config, EvalSet
from dsv4rl.eval.data import eval_problems
from dsv4rl.eval.presets import SamplingPreset, preset_overrides
from dsv4rl.eval.run import REPORT_FILE, evaluate_saved
from dsv4rl.eval.weights import scored_weights
from dsv4rl.export.for_eval import export_for_eval, run_checkpoints_note
from dsv4rl.launcher.engine_python import require_engine_python

# (the eval's config, the report file it writes) -> the report: the engines and the eval worker's run
RunTask = Callable[[Config, Path], dict[str, Any]]


def eval_config(
    eval_set: str,
    recipe: str,
    overrides: list[str],
    checkpoint: str | None,
    responses: str | None,
    preset: SamplingPreset | None,
    console: Console,
) -> Config:
    """The recipe with `eval=<eval_set>`, validated, its run dir <run.dir>/eval/<set> (or the checkpoint's
    run's, one directory per checkpoint). `checkpoint` is exported for the engines once."""
    cfg = compose(recipe, [f"eval={eval_set}", *preset_overrides(preset), *overrides])
    if cfg.eval is None:
        raise ConfigError(f"eval set {eval_set!r} evaluates nothing; choose one of {', '.join(EvalSet)}")
    eval_dir = Path(cfg.run.dir) / "eval" / eval_set
    if checkpoint is not None:  # a run's checkpoint: exported once, then scored as a model dir
        if responses is not None or any(a.startswith("model.path=") for a in overrides):
            raise ConfigError("checkpoint= names the weights to score: drop model.path= and --responses")
        found, exported = export_for_eval(checkpoint, cfg.quant.name, console)
        cfg.model.path = str(exported)
        run_given = any(a.startswith("run.dir=") for a in overrides)
        base = Path(cfg.run.dir) if run_given else found.run_dir
        eval_dir = base / "eval" / eval_set / found.path.name
    elif responses is None:
        note = run_checkpoints_note(Path(cfg.run.dir), scored_weights(cfg.model.path, eval_dir))
        if note:
            console.print(note, style="yellow", soft_wrap=True)
    cfg.run.dir = str(eval_dir)
    if responses is not None:  # nothing is sampled: the eval's cap does not bind the recipe's model
        cfg.eval.sampling = copy.deepcopy(cfg.algo.sampling)
    validate(cfg, check_paths=True)
    if responses is None:
        require_engine_python(cfg)
    return cfg


def run_eval(cfg: Config, responses: str | None, run_task: RunTask) -> tuple[dict[str, Any], Path]:
    """The report and where it is: `responses` graded without an engine, else `run_task` on the engines.
    An earlier report in the run dir is removed first, so its numbers are never shown as this run's."""
    run_dir = Path(cfg.run.dir).resolve()
    report_path = run_dir / REPORT_FILE
    report_path.unlink(missing_ok=True)
    if responses is not None:
        if not Path(responses).is_file():
            raise ConfigError(f"--responses {responses}: no such file")
        return evaluate_saved(cfg, Path(responses), run_dir), report_path
    eval_problems(cfg)  # a data problem is named before any engine starts
    return run_task(cfg, report_path), report_path
