"""The data files a run reads, read and checked before any process starts.

The trainer loads its training data and its periodic eval set only after the engines are up (minutes on a
cluster); a malformed row found then costs a start-up. `dsv4rl train` reads them first, with the same
loaders, so a bad row is refused at once with its file and line (`dsv4rl.data.datasets.DatasetError`).
"""

from __future__ import annotations

from dsv4rl.config.choices import Task
from dsv4rl.config.schema import Config


def data_file_problems(cfg: Config, task: Task = Task.train) -> list[str]:
    """What keeps the run's data from loading: one line per file (empty when all load)."""
    from dsv4rl.data.datasets import problem_source
    from dsv4rl.eval.data import eval_problems

    problems = []
    if task in (Task.train, Task.align) and cfg.data.path is not None:
        try:
            problem_source(cfg.data, cfg.seed)
        except (OSError, ValueError, ImportError) as error:  # DatasetError is a ValueError
            problems.append(f"data.path: {error}")
    periodic = cfg.eval is not None and cfg.eval.every_steps > 0
    if task == Task.train and periodic and cfg.eval.dataset is not None:
        try:
            eval_problems(cfg)
        except (OSError, ValueError, ImportError) as error:  # EvalDataError and DatasetError too
            problems.append(f"eval.dataset (the eval every {cfg.eval.every_steps} steps): {error}")
    return problems
