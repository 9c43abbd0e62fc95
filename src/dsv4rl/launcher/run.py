"""`dsv4rl train` on one node: check the run dir's lock, the ports, the run dir and the data, lock the run
dir, write the resolved recipe, build the tiny model, then hand this node's processes to the `Supervisor`.
Every refusal comes before anything is written. After a weight push that spent the engines, node 0 decides
whether the job may be requeued (`dsv4rl.faults.failed_push`).

Apart from the supervisor so that process handling stays free of run-dir and recipe concerns.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console
from rich.text import Text

from dsv4rl.checks.data_files import data_file_problems
from dsv4rl.config.choices import ProcessRole, ResumeMode, Task
from dsv4rl.config.compose import ConfigError
from dsv4rl.config.schema import Config
from dsv4rl.engine_client.engine_keys import EngineKeysError, engines_need_keys, ensure_engine_keys_file
from dsv4rl.engine_client.roster import restart_budget
from dsv4rl.faults.attempts import archive_attempt
from dsv4rl.faults.failed_push import FAILED_PUSH_EXIT, clear_failed_push, decide_requeue
from dsv4rl.faults.files import read_json, write_text_atomic
from dsv4rl.faults.run_outcome import RunOutcome, clear_run_outcome, write_run_outcome
from dsv4rl.faults.stop import clear_stop_files, stopped_path
from dsv4rl.launcher.marker import DoneMarker
from dsv4rl.launcher.node_liveness import NodeLiveness
from dsv4rl.launcher.plan import (
    ProcessSpec,
    build_local_plan,
    check_ports,
    config_path,
    remote_engine_health,
)
from dsv4rl.launcher.run_lock import RunDirInUse, RunLock, unwritable
from dsv4rl.launcher.supervisor import Supervisor
from dsv4rl.topology import engine_port_layout, topology


def write_config(cfg: Config, run_dir: Path) -> Path:
    """The resolved recipe the trainer reads (`--config`), with `run.dir` made absolute."""
    tree = OmegaConf.structured(cfg)
    tree.run.dir = str(run_dir)
    path = config_path(cfg, run_dir)
    write_text_atomic(path, OmegaConf.to_yaml(tree, resolve=True))  # fsynced: a resume reads it back
    return path


__all__ = ["RunDirInUse", "check_run_dir", "resume_command", "run_training", "write_config"]


def check_run_dir(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint a resumed run continues from (None: a fresh run). A fresh run must not mix its
    checkpoints and metrics with an earlier run's: resume=false on a run dir with a checkpoint is refused."""
    from dsv4rl.train.checkpoint_dirs import latest_checkpoint

    previous = latest_checkpoint(run_dir / "checkpoints")
    if previous is not None and not cfg.resume:
        raise RunDirInUse(
            f"{run_dir} already holds a run (checkpoint {previous.name}): pass resume=auto (or resume=true) "
            "to continue it, or choose a new run.dir"
        )
    if previous is None and cfg.resume == ResumeMode.true:  # starting over would rewrite what is there
        raise RunDirInUse(
            f"resume=true, but {run_dir / 'checkpoints'} holds no checkpoint to continue from (set "
            "train.checkpoint_every to save some): start a new run with resume=false and a new run.dir, or "
            "pass resume=auto to continue when there is a checkpoint and start fresh when there is none"
        )
    return previous if cfg.resume else None


def resume_command(cfg: Config) -> str:
    """The command that continues this run: this one with resume=auto."""
    argv = sys.argv[1:]
    if argv[:1] == ["train"] and any(arg.startswith("recipe=") for arg in argv):
        kept = [arg for arg in argv[1:] if not arg.lstrip("+~").startswith("resume=")]
        return shlex.join(["dsv4rl", "train", *kept, "resume=auto"])
    return f"dsv4rl train recipe={cfg.recipe} run.dir={cfg.run.dir} <the same overrides> resume=auto"


def _say_resume(cfg: Config, run_dir: Path, checkpoint: Path | None, console: Console) -> None:
    """On the console, not only in the trainer's log: whether this run continues one, and from where."""
    if not cfg.resume:
        return
    if checkpoint is not None:
        console.print(
            f"resume={cfg.resume}: continuing from {checkpoint} (the newest; the one before it if it cannot "
            "be read)",
            style="dim",
            soft_wrap=True,
        )
    else:  # resume=auto (resume=true without a checkpoint was refused in check_run_dir)
        console.print(f"resume=auto: no checkpoint in {run_dir / 'checkpoints'}: a fresh run", style="dim")


def run_training(
    cfg: Config, *, console: Console | None = None, plan_builder=build_local_plan, task: Task = Task.train
) -> int:
    """`dsv4rl train` (`dsv4rl align`, `dsv4rl eval`: their `task`): check ports, prepare the run dir and
    model, run the node's processes to the end."""
    console = console or Console()
    run_dir = Path(cfg.run.dir).resolve()
    lock = RunLock(run_dir, cfg.cluster.node_rank)  # each node of a run locks its own name
    holder = lock.holder()
    if holder is not None:  # a running launcher owns this run dir, whatever ports this one would use
        raise lock.refused(holder)
    check_ports(cfg)  # before anything is written or started
    remote_engines = remote_engine_health(cfg)  # ConfigError without cluster.node_addrs
    checkpoint = check_run_dir(cfg, run_dir) if task == Task.train else None
    problems = data_file_problems(cfg, task)  # the trainer would find them only after the engines are up
    if problems:
        listing = problems[0] if len(problems) == 1 else "\n" + "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"recipe {cfg.recipe!r}: {listing}", problems)
    if cfg.model.path is None:
        from dsv4rl.model.model_dir import ModelDirMismatch, check_model_dir

        try:  # before anything is written
            check_model_dir(cfg.model, run_dir / "model", cfg.quant)
        except ModelDirMismatch as error:
            raise RunDirInUse(str(error)) from None
    notice = lock.acquire()  # the first write: creates the run dir (one line, not a traceback, if it cannot)
    try:
        if notice:
            console.print(notice, style="bold yellow", soft_wrap=True)
        if task == Task.train:
            _say_resume(cfg, run_dir, checkpoint, console)
        return _run_locked(cfg, run_dir, console, plan_builder, task, remote_engines)
    finally:
        lock.release()


def _run_locked(
    cfg: Config,
    run_dir: Path,
    console: Console,
    plan_builder: Callable[..., list[ProcessSpec]],
    task: Task,
    remote_engines: list[tuple[str, str]],
) -> int:
    """The rest of `run_training`, while this launcher holds the run dir's lock."""
    try:
        (run_dir / "logs").mkdir(exist_ok=True)
        if engines_need_keys(cfg):
            try:
                ensure_engine_keys_file(run_dir)
            except EngineKeysError as error:
                raise RunDirInUse(str(error)) from None
        write_config(cfg, run_dir)
        if task == Task.train and cfg.cluster.node_rank == 0:
            archived = archive_attempt(run_dir)  # before anything of the earlier attempt is cut or cleared
            if archived is not None:
                console.print(f"the earlier attempt's metrics and fault records: {archived}", style="dim")
            clear_stop_files(run_dir)  # an earlier run's stop request must not stop this one
            clear_failed_push(run_dir)  # nor its failed push ask for a requeue
            clear_run_outcome(run_dir)  # nor its outcome describe this attempt while it runs
    except OSError as error:
        raise unwritable(run_dir, error) from None
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
        node_addrs=cfg.cluster.node_addrs,
        stop_grace_s=cfg.run.stop_grace_s if task == Task.train else 0.0,  # eval, align: a signal ends them
        resume_hint=resume_command(cfg),
        max_restarts=restart_budget(cfg) if task == Task.train else 0,
        engines=len(topology(cfg).engines),
        min_alive=cfg.engine.min_alive,
        health_timeout_s=cfg.engine.health_timeout_s,
        engine_port_offsets=engine_port_layout(cfg)[1],
    )
    code = supervisor.run()
    if task == Task.train and node == 0:
        if code == FAILED_PUSH_EXIT:
            code = _requeue_after_failed_push(cfg, run_dir, console)
        _write_outcome(run_dir, supervisor, code, console)
        _record_outcome(cfg, run_dir, supervisor, console)
    return code


def _write_outcome(run_dir: Path, supervisor: Supervisor, code: int, console: Console) -> None:
    """`<run_dir>/OUTCOME` for `dsv4rl report` and `dsv4rl rollouts`: how this attempt ended and why."""
    from dsv4rl.trackers.outcome import last_step

    status = supervisor.status or "failed"
    stopped = read_json(stopped_path(run_dir)) or {}
    reason = stopped.get("reason") if status == "stopped" else None
    cause = None if status == "finished" else supervisor.failure
    outcome = RunOutcome(status, last_step(run_dir), code, cause, reason if isinstance(reason, str) else None)
    try:
        write_run_outcome(run_dir, outcome)
    except OSError as error:  # the run's own result stands; only the record is missing
        console.print(Text(f"warning: could not write {run_dir / 'OUTCOME'}: {error}", style="yellow"))


def _requeue_after_failed_push(cfg: Config, run_dir: Path, console: Console) -> int:
    """A push spent the engines: allow a requeue while `cluster.max_requeues` allows one (the record says
    so for the batch script), else exit 1 for a person to look."""
    requeue = decide_requeue(run_dir, cfg.cluster.max_requeues)
    style = "bold yellow" if requeue.allowed else "bold red"
    console.print(Text(requeue.message(resume_command(cfg)), style=style), soft_wrap=True)
    return requeue.exit_code


def _record_outcome(cfg: Config, run_dir: Path, supervisor: Supervisor, console: Console) -> None:
    """The outcome and root cause into the run's trackers (logger=[...]), and where to find them."""
    from dsv4rl.trackers.outcome import record_outcome

    status = supervisor.status or "failed"
    cause = None if status == "finished" else supervisor.failure
    for line in record_outcome(cfg, run_dir, status, cause):
        console.print(Text(line, style="dim"), soft_wrap=True)
