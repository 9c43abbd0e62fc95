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
from dsv4rl.config.validate import validate

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
    """Refuse a recipe whose SGLang interpreter cannot serve this run (missing, no sglang, another torch)."""
    from dsv4rl.launcher.engine_python import check_engine_python

    problems = check_engine_python(cfg, nodes)
    if problems:
        text = problems[0]
        if len(problems) > 1:
            text = "the SGLang interpreter cannot serve this run:\n" + "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"recipe {cfg.recipe!r}: {text}{hint}", problems)


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


@app.command("align")
def align_command(
    args: RecipeArgs = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
) -> None:
    """Measure how far the engines' log-probs are from the trainer's after a (quantized) weight sync.

    Starts the recipe's engines and trainer, pushes the trainer's weights in the `quant` format, samples
    responses with the engines and recomputes their log-probs with the trainer on the same tokens.
    With the tiny model the trainer holds the unquantized weights and the engines the quantized ones.
    Files go to <run.dir>/align/<quant>/ (report: align.json).
    """
    from pathlib import Path

    try:
        recipe, overrides = _split_recipe(list(args or []))
        cfg = compose(recipe, overrides)
        cfg.run.dir = str(Path(cfg.run.dir) / "align" / cfg.quant.name.value)
        validate(cfg, check_paths=True)
        _check_engine_python(cfg)
    except ConfigError as exc:
        raise _fail(str(exc)) from None

    from dsv4rl.launcher.align_view import render_align
    from dsv4rl.launcher.plan import PortInUse
    from dsv4rl.launcher.run import RunDirInUse, run_training
    from dsv4rl.train.align import REPORT_FILE

    console = Console(stderr=True) if as_json else Console()
    report_path = Path(cfg.run.dir).resolve() / REPORT_FILE
    report_path.unlink(missing_ok=True)  # never show an earlier run's numbers
    try:
        code = run_training(cfg, console=console, task="align")
    except (ConfigError, PortInUse, RunDirInUse) as exc:
        raise _fail(str(exc)) from None
    except KeyboardInterrupt:
        code = 130
    if code != 0:
        raise typer.Exit(code=int(code))
    report = json.loads(report_path.read_text())
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        render_align(report, console)


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
