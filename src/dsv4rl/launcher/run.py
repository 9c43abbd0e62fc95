"""`dsv4rl train` on one node: check ports and the run dir, write the resolved recipe, build the tiny model,
then hand this node's processes to the `Supervisor`.

Apart from the supervisor so that process handling stays free of run-dir and recipe concerns.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console

from dsv4rl.config.schema import Config, ProcessRole, Task
from dsv4rl.launcher.marker import DoneMarker
from dsv4rl.launcher.node_liveness import NodeLiveness
from dsv4rl.launcher.plan import (
    build_local_plan,
    check_ports,
    config_path,
    remote_engine_health,
)
from dsv4rl.launcher.supervisor import Supervisor
from dsv4rl.rollout.engine_keys import EngineKeysError, engines_need_keys, ensure_engine_keys_file


def write_config(cfg: Config, run_dir: Path) -> Path:
    """The resolved recipe the trainer reads (`--config`), with `run.dir` made absolute."""
    tree = OmegaConf.structured(cfg)
    tree.run.dir = str(run_dir)
    path = config_path(cfg, run_dir)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(OmegaConf.to_yaml(tree, resolve=True))
    tmp.replace(path)
    return path


class RunDirInUse(ValueError):
    """The run dir belongs to an earlier run and resume was not asked for."""


def check_run_dir(cfg: Config, run_dir: Path) -> None:
    """A fresh run must not mix its checkpoints and metrics with an earlier run's."""
    from dsv4rl.train.checkpoint_dirs import latest_checkpoint

    if cfg.resume:
        return
    previous = latest_checkpoint(run_dir / "checkpoints")
    if previous is not None:
        raise RunDirInUse(
            f"{run_dir} already holds a run (checkpoint {previous.name}): pass resume=true to continue it, "
            "or choose a new run.dir"
        )


def run_training(
    cfg: Config, *, console: Console | None = None, plan_builder=build_local_plan, task: Task = Task.train
) -> int:
    """`dsv4rl train` (`dsv4rl align`, `dsv4rl eval`: their `task`): check ports, prepare the run dir and
    model, run the node's processes to the end."""
    console = console or Console()
    run_dir = Path(cfg.run.dir).resolve()
    check_ports(cfg)  # before anything is written or started
    remote_engines = remote_engine_health(cfg)  # ConfigError without cluster.node_addrs
    if task == Task.train:
        check_run_dir(cfg, run_dir)
    if cfg.model.path is None:
        from dsv4rl.model.model_dir import ModelDirMismatch, check_model_dir

        try:  # before anything is written
            check_model_dir(cfg.model, run_dir / "model", cfg.quant)
        except ModelDirMismatch as error:
            raise RunDirInUse(str(error)) from None
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    if engines_need_keys(cfg):
        try:
            ensure_engine_keys_file(run_dir)
        except EngineKeysError as error:
            raise RunDirInUse(str(error)) from None
    write_config(cfg, run_dir)
    if cfg.model.path is None:
        from dsv4rl.config.schema import QuantConfig
        from dsv4rl.model.model_dir import materialize_model, source_model_dir

        with console.status(f"building the tiny model from its seed (quant={cfg.quant.name.value}) ..."):
            materialize_model(cfg.model, str(run_dir / "model"), cfg.quant)
            if task == Task.align:  # the trainer holds the unquantized weights
                materialize_model(cfg.model, str(source_model_dir(run_dir)), QuantConfig())
    specs = plan_builder(cfg, run_dir, task=task)
    node, multi_node = cfg.cluster.node_rank, cfg.cluster.nnodes > 1
    marker = None
    if multi_node and node == 0:
        marker = DoneMarker(run_dir)
        marker.clear()  # an earlier run's; rollout-only nodes ignore it anyway
    elif multi_node and not any(s.role == ProcessRole.trainer for s in specs):
        marker = DoneMarker(run_dir)
    liveness = None
    if multi_node:
        c = cfg.cluster
        liveness = NodeLiveness(run_dir, node, c.nnodes, c.node_timeout_s, cfg.engine.startup_timeout_s)
    supervisor = Supervisor(
        specs,
        run_dir,
        total_steps=cfg.train.steps if task == Task.train else 0,
        console=console,
        live=cfg.run.progress and sys.stdout.isatty() and node == 0 and task == Task.train,
        startup_timeout_s=cfg.engine.startup_timeout_s,
        step_timeout_s=cfg.run.step_timeout_s,
        remote_engines=remote_engines,
        done_marker=marker,
        show_progress=node == 0 and task == Task.train,  # nodes share one log under srun: one display
        liveness=liveness,
        log_every=cfg.train.log_every,
    )
    return supervisor.run()
