"""Rank 0's trackers: every step's metrics, the composed config and the plan's estimates go to each tracker
the recipe lists. A tracker that raises is named once on the console and dropped; the others and the run
go on (metrics.jsonl, written before them, has every step either way)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dsv4rl.config.choices import LoggerKind
from dsv4rl.config.compose import to_dictconfig
from dsv4rl.config.schema import Config
from dsv4rl.estimate.memory import memory_plan
from dsv4rl.estimate.step_time import step_time
from dsv4rl.faults.notices import notify
from dsv4rl.trackers.state import TrackerState, read_state, write_state

log = logging.getLogger(__name__)


def config_dict(cfg: Config) -> dict[str, Any]:
    """The composed recipe as plain JSON-able data (enums as their values)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(to_dictconfig(cfg), resolve=True, enum_to_str=True)


def plan_estimates(cfg: Config) -> dict[str, Any]:
    """What `dsv4rl plan` estimated for this recipe: the step time and the memory per GPU (None where the
    recipe has nothing to estimate against, such as a CPU run)."""
    timing = step_time(cfg)
    memory = memory_plan(cfg)
    return {
        "step_time": timing.to_json() if timing is not None else None,
        "memory": {
            "device": memory.device,
            "device_gb": memory.device_gb,
            "skipped": memory.skipped,
            "peak_gb": max((g.total_gb for g in memory.gpus), default=None),
            "gpus": [{**asdict(g), "role": g.role.value} for g in memory.gpus],
        },
    }


class Trackers:
    """The trackers that opened; each call goes to all of them, a failure drops only the one that raised."""

    def __init__(self, trackers: list[Any], state: TrackerState, run_dir: Path) -> None:
        self.trackers = trackers
        self.state = state
        self.run_dir = run_dir

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def _each(self, what: str, call: Callable[[Any], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as error:  # any library error: the run must not stop for a tracker
                self.trackers.remove(tracker)
                notify(
                    f"the {tracker.name} tracker failed to {what} ({type(error).__name__}: {error}); it is "
                    "turned off for the rest of the run, metrics.jsonl and the other trackers go on",
                    log,
                )
                _close_quietly(tracker)

    def log_config(self, config: Mapping[str, object]) -> None:
        self._each("log the config", lambda t: t.log_config(config))

    def log_plan(self, plan: Mapping[str, object]) -> None:
        self._each("log the plan's estimates", lambda t: t.log_plan(plan))

    def log_step(self, step: int, metrics: Mapping[str, object]) -> None:
        self._each(f"log step {step}", lambda t: t.log_step(step, metrics))
        self.state.tensorboard_step = step

    def log_outcome(self, outcome: str, root_cause: str | None, step: int) -> None:
        self._each("log the outcome", lambda t: t.log_outcome(outcome, root_cause, step))

    def state_dict(self) -> dict:
        """For the checkpoint: a resume continues these tracker runs."""
        return self.state.to_dict()

    def close(self) -> None:
        for tracker in self.trackers:
            _close_quietly(tracker)
        self.trackers = []


def _close_quietly(tracker: Any) -> None:
    try:
        tracker.close()
    except Exception as error:  # closing a broken tracker must not hide the first error
        log.warning("closing the %s tracker failed: %s", tracker.name, error)


def open_trackers(
    cfg: Config,
    run_dir: str | Path,
    resumed: Mapping[str, Any] | None = None,
    resume_step: int = 0,
    with_history: bool = True,
) -> Trackers:
    """The trackers `cfg.logger` lists, on rank 0. `resumed`: the tracker state a checkpoint kept (its
    W&B run is continued); else the run dir's state file when resuming, else a new W&B run id.
    `with_history=False`: opened only to record the outcome (no step purge, no config)."""
    from dsv4rl.trackers.wandb_log import wandb_mode

    run_dir = Path(run_dir)
    if resumed:
        state = TrackerState.from_dict(dict(resumed))
    else:
        state = (read_state(run_dir) if resume_step > 0 or not with_history else None) or TrackerState()
    opened: list[Any] = []
    for kind in cfg.logger:
        try:
            if kind == LoggerKind.tensorboard:
                from dsv4rl.trackers.tensorboard_log import TensorBoardTracker

                opened.append(TensorBoardTracker(run_dir, resume_step if with_history else None))
            elif kind == LoggerKind.wandb:
                from dsv4rl.trackers.wandb_log import WandbTracker

                mode = state.wandb_mode or wandb_mode()
                state.wandb_mode = mode
                opened.append(WandbTracker(cfg.tracker.wandb, run_dir, state.wandb_id, mode))
        except Exception as error:  # no tracker at all rather than no run
            notify(
                f"the {kind.value} tracker could not start ({type(error).__name__}: {error}); the run goes "
                "on without it (metrics.jsonl has every step)",
                log,
            )
    state.tensorboard_step = resume_step
    trackers = Trackers(opened, state, run_dir)
    if opened and with_history:
        write_state(run_dir, state)
        trackers.log_config(config_dict(cfg))
        try:
            plan = plan_estimates(cfg)
        except Exception as error:  # an estimate that cannot be made is no reason to stop the run
            plan = {"error": f"{type(error).__name__}: {error}"}
        trackers.log_plan(plan)
    return trackers
