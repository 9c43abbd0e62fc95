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

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console

from dsv4rl.checks.validate import validate
from dsv4rl.config.choices import EvalScoredBy, EvalSet
from dsv4rl.config.compose import ConfigError, compose, load_config_file, to_dictconfig
from dsv4rl.config.schema import Config
from dsv4rl.eval.data import eval_problems
from dsv4rl.eval.presets import SamplingPreset, preset_overrides
from dsv4rl.eval.run import REPORT_FILE, evaluate_saved
from dsv4rl.eval.weights import scored_weights
from dsv4rl.export.for_eval import export_for_eval, run_checkpoints_note
from dsv4rl.export.sources import find_checkpoint
from dsv4rl.launcher.engine_python import require_engine_python

# (the eval's config, the report file it writes) -> the report: the engines and the eval worker's run
RunTask = Callable[[Config, Path], dict[str, Any]]
RECIPE_DIR_SUFFIX = "-recipe"  # <run.dir>/eval/<set>-recipe: the recipe's task, beside the set's own eval
DEFAULT_RECIPE = "tiny_arith"  # the recipe an eval without recipe= (or a run's checkpoint) uses


def eval_config(
    eval_set: str | None,
    recipe: str | None,
    overrides: list[str],
    checkpoint: str | None,
    responses: str | None,
    preset: SamplingPreset | None,
    console: Console,
) -> Config:
    """The recipe with `eval=<eval_set>`, validated, its run dir <run.dir>/eval/<set> (or the checkpoint's
    run's, one directory per checkpoint). `checkpoint` is exported for the engines once.

    With no eval set named, the recipe's own task (`recipe_task`): its eval group's problems, sampled with
    `algo.sampling` and graded by its reward, in <run.dir>/eval/<set>-recipe; `recipe` None with a
    checkpoint takes the checkpoint's run's saved config (its recipe and overrides, its reward.fns)."""
    if eval_set is None and recipe is None and checkpoint is not None:
        cfg = run_config(checkpoint, [*preset_overrides(preset), *overrides])
    else:
        chosen = [f"eval={eval_set}"] if eval_set is not None else []
        cfg = compose(recipe or DEFAULT_RECIPE, [*chosen, *preset_overrides(preset), *overrides])
    if cfg.eval is None:
        if eval_set is not None:
            raise ConfigError(f"eval set {eval_set!r} evaluates nothing; choose one of {', '.join(EvalSet)}")
        raise ConfigError(
            f"recipe {cfg.recipe!r} has no eval set (eval: none), so it has no problems to evaluate: add "
            f"eval=<set> to grade that set's problems with the recipe's reward (e.g. "
            f"eval={EvalSet.tiny_arith}), or name the set first (`dsv4rl eval {EvalSet.tiny_arith} ...`) to "
            "grade with the set's own grader"
        )
    if eval_set is None:
        recipe_task(cfg)
    where = Path("eval") / (cfg.eval.name if eval_set is not None else f"{cfg.eval.name}{RECIPE_DIR_SUFFIX}")
    eval_dir = Path(cfg.run.dir) / where
    if checkpoint is not None:  # a run's checkpoint: exported once, then scored as a model dir
        if responses is not None or any(a.startswith("model.path=") for a in overrides):
            raise ConfigError("checkpoint= names the weights to score: drop model.path= and --responses")
        found, exported = export_for_eval(checkpoint, cfg.quant.name, console)
        cfg.model.path = str(exported)
        run_given = any(a.startswith("run.dir=") for a in overrides)
        base = Path(cfg.run.dir) if run_given else found.run_dir
        eval_dir = base / where / found.path.name
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


def recipe_task(cfg: Config) -> None:
    """Make `cfg.eval` the recipe's task: its eval set's problems (and samples per problem), sampled with
    the recipe's `algo.sampling` (its temperature, top-p and max_new_tokens, not the set's), scored by
    the recipe's reward (`eval.scored_by: recipe`)."""
    assert cfg.eval is not None
    cfg.eval.sampling = copy.deepcopy(cfg.algo.sampling)
    cfg.eval.scored_by = EvalScoredBy.recipe


def run_config(checkpoint: str, overrides: list[str]) -> Config:
    """The saved config.yaml of the run `checkpoint` belongs to, with `key=value` overrides on top: the
    run's recipe and its own overrides (reward.fns included), as it trained."""
    found = find_checkpoint(checkpoint)
    path = found.run_dir / "config.yaml"
    groups = [a for a in overrides if "=" in a and "." not in a.split("=", 1)[0].lstrip("+")]
    if groups:
        raise ConfigError(
            f"{groups}: a run's saved config takes key=value overrides (e.g. eval.max_problems=8), not "
            "config groups; to evaluate with another recipe or group, add recipe=NAME"
        )
    cfg = load_config_file(path)
    if not overrides:
        return cfg
    try:
        given = OmegaConf.from_dotlist([a.lstrip("+") for a in overrides])
        merged = OmegaConf.merge(to_dictconfig(cfg), given)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{' '.join(overrides)}: {exc.msg} (on the saved config {path})") from None


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
