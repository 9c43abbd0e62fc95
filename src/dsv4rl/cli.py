"""The `dsv4rl` command line: compose a recipe, validate it, hand it to the node supervisor.

Kept thin on purpose: composition and validation live in `dsv4rl.config`, process management in
`dsv4rl.launcher`. A bad recipe or override prints one red message and exits 2, without a traceback.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from dsv4rl.checks.validate import validate
from dsv4rl.config.choices import AlignFeature, RolloutSort, Task
from dsv4rl.config.compose import (
    ConfigError,
    compose,
    describe,
    find_recipes_dir,
    list_groups,
    list_recipes,
    to_yaml,
)
from dsv4rl.config.schema import Config

app = typer.Typer(
    name="dsv4rl",
    help="GRPO/DAPO post-training of DeepSeek-V4 MoE models: SGLang rollouts, FSDP/Megatron training, "
    "checkpoint-free weight sync.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

EXIT_CONFIG = 2


def _fail(message: str) -> typer.Exit:
    Console(stderr=True).print(Text(f"error: {message}", style="red"), soft_wrap=True)
    return typer.Exit(code=EXIT_CONFIG)


def _print_yaml(text: str) -> None:
    """Highlighted on a terminal; plain (exact, uncropped YAML) when piped to a file."""
    console = Console()
    if console.is_terminal:
        console.print(Syntax(text, "yaml", background_color="default", word_wrap=True))
    else:
        typer.echo(text, nl=False)


def _split_recipe(args: list[str]) -> tuple[str, list[str]]:
    """Take `recipe=NAME` out of the Hydra-style arguments."""
    recipes = [a for a in args if a.startswith("recipe=")]
    rest = [a for a in args if not a.startswith("recipe=")]
    if not recipes:
        raise ConfigError(
            f"no recipe given: pass recipe=NAME (available: {', '.join(list_recipes())}), "
            "e.g. `dsv4rl train recipe=tiny_arith`"
        )
    if len(recipes) > 1:
        raise ConfigError(f"recipe= given {len(recipes)} times ({', '.join(recipes)}); pass it once")
    return recipes[0].removeprefix("recipe="), rest


def _check_engine_python(cfg: Config, nodes: list[int] | None = None, hint: str = "") -> None:
    from dsv4rl.launcher.engine_python import require_engine_python

    require_engine_python(cfg, nodes, hint)


# `recipe=NAME` then Hydra overrides: every command that takes a recipe takes them the same way.
RecipeArgs = Annotated[
    list[str] | None,
    typer.Argument(
        metavar="recipe=NAME [OVERRIDES]...",
        help="recipe=NAME then Hydra overrides: key=value, +key=value, group=option "
        "(e.g. run.dir=runs/demo algo.group_size=4 parallel=cpu_fsdp2 quant=fp8_mxfp4 resume=true).",
        show_default=False,
    ),
]


@app.command()
def train(
    args: RecipeArgs = None,
    print_config: Annotated[
        bool,
        typer.Option(
            "--cfg", "--print-config", help="Print the composed config and exit (no path checks, no run)."
        ),
    ] = False,
) -> None:
    """Compose and validate a recipe, then start this node's share of the run."""
    try:
        recipe, overrides = _split_recipe(list(args or []))
        cfg = compose(recipe, overrides)
        if print_config:
            _print_yaml(to_yaml(cfg))
            validate(cfg, check_paths=False)
            raise typer.Exit(code=0)
        validate(cfg, check_paths=True)
        _check_engine_python(cfg)
    except ConfigError as exc:
        raise _fail(str(exc)) from None

    from dsv4rl.launcher.plan import PortInUse  # heavy imports only when a run starts
    from dsv4rl.launcher.run import RunDirInUse, run_training

    try:
        code = run_training(cfg)
    except (ConfigError, PortInUse, RunDirInUse) as exc:
        raise _fail(str(exc)) from None
    except KeyboardInterrupt:
        code = 130
    raise typer.Exit(code=int(code))


def _run_task_for_report(cfg: Config, task: Task, console: Console, report_path) -> dict:  # noqa: ANN001
    """Run the node's engines with `task`'s process in the trainer's place, then read what it wrote."""
    from dsv4rl.launcher.plan import PortInUse
    from dsv4rl.launcher.run import RunDirInUse, run_training

    try:
        code = run_training(cfg, console=console, task=task)
    except (ConfigError, PortInUse, RunDirInUse) as exc:
        raise _fail(str(exc)) from None
    except KeyboardInterrupt:
        code = 130
    if code != 0:
        raise typer.Exit(code=int(code))
    return json.loads(report_path.read_text())


@app.command("align")
def align_command(
    args: RecipeArgs = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    attribute: Annotated[
        bool,
        typer.Option(
            "--attribute",
            help="Toggle each alignment feature (replays, fp32 LM head, trainer-side rounding) on fixed "
            "sequences and report what each contributes (align.attribute names a subset).",
        ),
    ] = False,
) -> None:
    """Measure how far the engines' log-probs are from the trainer's after a (quantized) weight sync.

    Starts the recipe's engines and trainer, pushes the trainer's weights in the `quant` format, samples
    responses with the engines and recomputes their log-probs with the trainer on the same tokens.
    With the tiny model the trainer holds the unquantized weights and the engines the quantized ones.
    Files go to <run.dir>/align/<quant>/ (report: align.json). With --attribute: one run per engine start
    the grid needs, on one fixed set of sampled sequences, into <run.dir>/align/<quant>/attribute/
    (report: attribute.json; docs/attribution.md).
    """
    from pathlib import Path

    try:
        recipe, overrides = _split_recipe(list(args or []))
        cfg = compose(recipe, overrides)
        attribute = attribute or cfg.align.attribute is not None
        cfg.run.dir = str(
            Path(cfg.run.dir) / "align" / cfg.quant.name.value / ("attribute" if attribute else "")
        )
        validate(cfg, check_paths=True)
        _check_engine_python(cfg)
        if attribute:
            from dsv4rl.launcher.attribute_run import resolve_features

            features, skipped = resolve_features(cfg)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    if attribute:
        _align_attribute(cfg, features, skipped, as_json)
        return

    from dsv4rl.launcher.align_view import render_align
    from dsv4rl.train.align import REPORT_FILE

    console = Console(stderr=True) if as_json else Console()
    report_path = Path(cfg.run.dir).resolve() / REPORT_FILE
    report_path.unlink(missing_ok=True)  # never show an earlier run's numbers
    report = _run_task_for_report(cfg, Task.align, console, report_path)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        render_align(report, console)


def _align_attribute(
    cfg: Config, features: list[AlignFeature], skipped: dict[str, str], as_json: bool
) -> None:
    """One align run per engine start of the attribution grid, then the merged report."""
    from dsv4rl.launcher.align_view import render_attribution
    from dsv4rl.launcher.attribute_run import run_attribution

    console = Console(stderr=True) if as_json else Console()
    try:
        report = run_attribution(
            cfg, features, skipped, lambda run, path: _run_task_for_report(run, Task.align, console, path)
        )
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        render_attribution(report, console)


def _split_eval_args(args: list[str]) -> tuple[str | None, list[str]]:
    """`recipe=` (None when not given) and the overrides; `data.path=` names the eval set's file here."""
    recipe, overrides = _split_recipe(args) if any(a.startswith("recipe=") for a in args) else (None, args)
    return recipe, [
        f"eval.dataset={a.removeprefix('data.path=')}" if a.startswith("data.path=") else a for a in overrides
    ]


@app.command("eval")
def eval_command(
    eval_set: Annotated[
        str | None,
        typer.Argument(
            metavar="EVAL_SET",
            help="The eval set: aime24, math500, gsm8k, dapo_math_holdout, tiny_arith (recipes/eval/), "
            "graded by its own grader with its own sampling. Left out: the recipe's task, its eval set's "
            "problems sampled with algo.sampling and graded by its reward.fns.",
            show_default=False,
        ),
    ] = None,
    args: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[recipe=NAME] [checkpoint=RUN] [OVERRIDES]...",
            help="The recipe whose model and engines to evaluate (default tiny_arith; with checkpoint= and "
            "no set, the run's own saved config), then Hydra overrides; data.path=<file> is the eval set's "
            "file (or set DSV4RL_DATA_DIR).",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    responses: Annotated[
        str | None,
        typer.Option(
            "--responses",
            help='Grade saved generations instead of sampling: JSON lines {"id": ..., "responses": [...]}.',
        ),
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            "--preset", help="Sampling preset: dapo (T 1.0, top-p 0.7) or deepseek_r1 (T 0.6, top-p 0.95)."
        ),
    ] = None,
) -> None:
    """Score a model on an eval set: unbiased pass@k (k = 1, 2, 4, ... n), avg@n, maj@n, truncation.

    With no eval set named, the recipe's own task: its reward functions grade (a response passes when its
    reward total reaches eval.pass_reward, default the functions' weight sum) and avg@n is the mean reward.
    Starts the recipe's engines (the reference engine on CPU, SGLang on GPUs) under the node supervisor,
    samples n responses per problem, grades them and writes <run.dir>/eval/<set>/eval.json. With
    --responses no engine starts: the saved responses are graded.
    """
    from dsv4rl.eval.presets import SamplingPreset

    try:
        chosen = SamplingPreset(preset) if preset is not None else None
    except ValueError:
        raise _fail(
            f"--preset {preset!r} is unknown; choose one of {[p.value for p in SamplingPreset]}"
        ) from None
    from dsv4rl.eval.view import render_eval
    from dsv4rl.export.for_eval import split_checkpoint_arg
    from dsv4rl.launcher.eval_run import eval_config, run_eval
    from dsv4rl.reward.results import RewardError

    console = Console(stderr=True) if as_json else Console()
    try:
        words = list(args or [])
        if eval_set is not None and "=" in eval_set:  # the first word is an override: no eval set named
            eval_set, words = None, [eval_set, *words]
        checkpoint, plain_args = split_checkpoint_arg(words)
        recipe, overrides = _split_eval_args(plain_args)
        cfg = eval_config(eval_set, recipe, overrides, checkpoint, responses, chosen, console)
        report, report_path = run_eval(
            cfg, responses, lambda run, path: _run_task_for_report(run, Task.eval, console, path)
        )
    except ValueError as exc:  # ConfigError, ExportError, EvalDataError, ResponsesError: named problems
        raise _fail(str(exc)) from None
    except RewardError as exc:  # the recipe's reward failed on the saved responses: loud, never a low score
        Console(stderr=True).print(Text(f"error: {exc}", style="red"), soft_wrap=True)
        raise typer.Exit(code=1) from None
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        render_eval(report, console, str(report_path))


@app.command("export")
def export_command(
    run_dir: Annotated[
        str,
        typer.Argument(
            help="The run's directory (its run.dir), or one of its checkpoints/step_N directories.",
            show_default=False,
        ),
    ],
    out: Annotated[str, typer.Option("--out", help="The model directory to write.", show_default=False)],
    step: Annotated[
        int | None, typer.Option("--step", help="The checkpoint's step (default: the newest complete one).")
    ] = None,
    fmt: Annotated[
        str, typer.Option("--format", help="native: the release's names (SGLang); hf: transformers' names.")
    ] = "native",
    quant: Annotated[
        str, typer.Option("--quant", help="none (the trainer's dtype), bf16, fp8_rollout or fp8_mxfp4.")
    ] = "none",
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty --out.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the export's record as JSON.")] = False,
) -> None:
    """Write a training checkpoint (FSDP or Megatron, any layout) as a model directory: sharded
    safetensors with an index, config.json with the release's keys, the tokenizer, dsv4rl-export.json."""
    from dsv4rl.config.choices import ExportFormat, QuantMode, choice

    try:
        chosen_format = choice(ExportFormat, fmt, "--format")
        chosen_quant = choice(QuantMode, quant, "--quant")
    except ValueError as exc:
        raise _fail(str(exc)) from None
    from dsv4rl.export.sources import ExportError
    from dsv4rl.export.view import export_with_progress, print_export

    console = Console(stderr=True) if as_json else Console()
    try:
        record = export_with_progress(
            console, target=run_dir, out=out, step=step, fmt=chosen_format, quant=chosen_quant, force=force
        )
    except ExportError as exc:
        raise _fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(record, indent=2))
    else:
        print_export(record, console)


@app.command("plan")
def plan_command(
    args: RecipeArgs = None,
    node_rank: Annotated[
        int | None,
        typer.Option("--node-rank", help="Show this node (default: cluster.node_rank of the recipe)."),
    ] = None,
    all_nodes: Annotated[bool, typer.Option("--all-nodes", help="Show every node of the cluster.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    skip_engine_check: Annotated[
        bool,
        typer.Option(
            "--skip-engine-check",
            help="Do not probe engine.python (on a machine that is not a cluster node, where the SGLang "
            "environment is not installed).",
        ),
    ] = False,
) -> None:
    """Show the processes each node would start (commands, env, ports, GPUs), without starting anything."""
    try:
        recipe, overrides = _split_recipe(list(args or []))
        cfg = compose(recipe, overrides)
        validate(cfg, check_paths=False)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    if all_nodes and node_rank is not None:
        raise _fail("--node-rank and --all-nodes exclude each other: pass one")
    nnodes = cfg.cluster.nnodes
    nodes = list(range(nnodes)) if all_nodes else [cfg.cluster.node_rank if node_rank is None else node_rank]
    if not all(0 <= n < nnodes for n in nodes):
        raise _fail(f"--node-rank {nodes[0]} is outside 0..{nnodes - 1} (cluster.nnodes={nnodes})")
    if not skip_engine_check:
        from dsv4rl.launcher.engine_python import SKIP_HINT

        try:
            _check_engine_python(cfg, nodes, hint=f" {SKIP_HINT}")
        except ConfigError as exc:
            raise _fail(str(exc)) from None
    try:  # what `dsv4rl train` would refuse on this machine: shown, not fatal
        validate(cfg, check_paths=True)
        warnings: list[str] = []
    except ConfigError as exc:
        warnings = [f"`dsv4rl train` here would stop: {p}" for p in exc.problems]

    from dsv4rl.launcher.plan_view import cluster_plan, render_plan

    try:
        plan = cluster_plan(cfg, nodes, warnings)
    except ValueError as exc:  # a layout the planner cannot place (GPUs, node ranks)
        raise _fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(plan, indent=2))
    else:
        render_plan(plan, Console())


@app.command("prompts")
def prompts_command(
    args: RecipeArgs = None,
    n: Annotated[int, typer.Option("--n", help="How many prompts to show (the data set's first).")] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Show what the model will see: the first N training prompts as rendered (data.chat_format) and
    tokenized, their token counts, the prompt-length distribution and how many rows max_prompt_len drops."""
    try:
        recipe, overrides = _split_recipe(list(args or []))
        cfg = compose(recipe, overrides)
        validate(cfg, check_paths=False)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    if n < 0:
        raise _fail(f"--n must be >= 0 (got {n})")
    from pathlib import Path

    from dsv4rl.config.compose import reward_base_dirs
    from dsv4rl.data.chat_format import PromptRenderer, data_chat_settings
    from dsv4rl.data.prompt_report import prompt_report
    from dsv4rl.model.tokenizer import run_tokenizer
    from dsv4rl.model.tokenizer_files import has_tokenizer
    from dsv4rl.rollout.multi_turn import build_multi_turn

    if cfg.data.path is not None and not Path(cfg.data.path).expanduser().is_file():
        raise _fail(
            f"data.path {cfg.data.path!r} does not exist: pass data.path=<jsonl or parquet file> or set "
            "DSV4RL_DATA_DIR to the data directory"
        )
    own = cfg.model.path is not None and has_tokenizer(Path(cfg.model.path).expanduser())
    try:
        tokenizer = run_tokenizer(cfg.model)
        settings = data_chat_settings(cfg.data)
        multi = build_multi_turn(cfg, tokenizer, settings, reward_base_dirs(cfg))  # the tools' schemas
        renderer = multi.renderer if multi is not None else PromptRenderer(tokenizer, settings)
        report = prompt_report(cfg, renderer, n, cfg.model.path if own else cfg.model.tokenizer)
    except (ValueError, ImportError) as exc:  # a tokenizer without the chat tokens, a bad data row
        raise _fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(report, ensure_ascii=False))
        return
    from dsv4rl.data.prompt_report import render_prompts

    render_prompts(report, Console())


@app.command("report")
def report_command(
    run_dir: Annotated[
        str,
        typer.Argument(help="The run's directory (its run.dir), holding metrics.jsonl.", show_default=False),
    ],
    out: Annotated[
        str | None,
        typer.Option("--out", help="Folder for the PNGs and report.md (default: RUN_DIR/report)."),
    ] = None,
) -> None:
    """Plot a run's metrics (one PNG per topic) and summarize it in report.md, from metrics.jsonl alone.

    Works on a run still going (its partial last line is skipped) and on one stopped early. A line that is
    not a step's JSON object is skipped with a warning naming its line number, also listed in report.md.
    """
    from dsv4rl.report import ReportError, build_report, print_report  # matplotlib only for this command

    try:
        report = build_report(run_dir, out)
    except ReportError as exc:
        raise _fail(str(exc)) from None
    print_report(report, Console())


@app.command("rollouts")
def rollouts_command(
    run_dir: Annotated[
        str, typer.Argument(help="The run's directory (its run.dir), holding rollouts/.", show_default=False)
    ],
    step: Annotated[
        int | None, typer.Option("--step", help="The step to show (default: the last saved).")
    ] = None,
    n: Annotated[int, typer.Option("--n", help="How many of the best and of the worst samples to show.")] = 3,
    sort: Annotated[RolloutSort, typer.Option("--sort", help="Order by total reward or response length.")] = (
        RolloutSort.reward
    ),
    as_json: Annotated[bool, typer.Option("--json", help="Every sample of the step, as JSON.")] = False,
) -> None:
    """Show what the model wrote at a step (saved with run.save_rollouts=N): the best and the worst samples,
    their prompt and response, and each reward function's result."""
    from dsv4rl.report.metrics_table import ReportError
    from dsv4rl.report.rollouts import load_step, render_rollouts, run_end, select

    if n < 0:
        raise _fail(f"--n must be >= 0 (got {n})")
    try:
        chosen, records = load_step(run_dir, step)
    except ReportError as exc:
        raise _fail(str(exc)) from None
    ended = run_end(run_dir)  # a crashed or stopped run's last saved step is all there will be
    if as_json:
        typer.echo(json.dumps({"step": chosen, "samples": records, "run_end": ended}, ensure_ascii=False))
        return
    console = Console()
    if ended:
        console.print(Text(f"run {ended}", style="bold yellow"), soft_wrap=True)
    top, bottom = select(records, n, sort)
    render_rollouts(chosen, top, bottom, sort, console, len(records))


def _split_optional_recipe(args: list[str]) -> tuple[str | None, list[str]]:
    """`_split_recipe` for commands that also run without a recipe (overrides then need one)."""
    if any(a.startswith("recipe=") for a in args):
        return _split_recipe(args)
    if args:
        raise ConfigError(
            f"overrides without a recipe ({' '.join(args)}): pass recipe=NAME first "
            f"(available: {', '.join(list_recipes())})"
        )
    return None, []


@app.command("doctor")
def doctor_command(
    args: RecipeArgs = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    probe: Annotated[
        bool,
        typer.Option(
            "--probe", help="Also time all-reduce and broadcast across this node's GPUs (CPU: gloo, 2 ranks)."
        ),
    ] = False,
) -> None:
    """Check this node before a run: software, GPUs, host settings, RDMA, environment, network, storage.

    Each check says PASS, WARN, FAIL or SKIP with a one-line remedy. With recipe=NAME [OVERRIDES] the
    environment, ports and paths are checked against the recipe; without one, those checks SKIP.
    Exits 1 when any check FAILs.
    """
    try:
        recipe, overrides = _split_optional_recipe(list(args or []))
        cfg = None if recipe is None else compose(recipe, overrides)
        if cfg is not None:
            validate(cfg, check_paths=False)
    except ConfigError as exc:
        raise _fail(str(exc)) from None

    from dsv4rl.doctor.probe import SystemProbe
    from dsv4rl.doctor.report import render, run_checks

    report = run_checks(SystemProbe(), cfg, bandwidth=probe)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        render(report, Console())
    raise typer.Exit(code=report.exit_code)


@app.command("recipes")
def recipes_command() -> None:
    """List the recipes and the options of every config group."""
    try:
        root = find_recipes_dir()
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    console = Console()
    table = Table(title=f"recipes ({root})", show_lines=False)
    table.add_column("recipe", style="bold")
    table.add_column("description")
    for name in list_recipes(root):
        table.add_row(name, describe(root / f"{name}.yaml"))
    console.print(table)
    groups = Table(title="config groups (override with group=option)")
    groups.add_column("group", style="bold")
    groups.add_column("options")
    for group, options in list_groups(root).items():
        groups.add_row(group, ", ".join(options))
    console.print(groups)


def main() -> None:  # pragma: no cover - `python -m dsv4rl.cli`
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
