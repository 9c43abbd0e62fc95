"""Training's own eval: every `eval.every_steps` steps, right after the weight sync, rank 0 samples the
recipe's eval set on the rollout engines (which now hold that step's weights) and the step's line of
metrics.jsonl gets `eval/pass@k` (the recipe's `eval.k`), `eval/avg@n`, `eval/maj@n`,
`eval/truncation_ratio`, `eval/response_len_mean`; the full report goes to `<run.dir>/eval/step_<N>.json`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsv4rl.config.schema import Config
from dsv4rl.eval.data import eval_problems
from dsv4rl.eval.run import evaluate_on_engines, write_report
from dsv4rl.reward.graders import get_grader
from dsv4rl.wire.engine_api import EngineAPI

__all__ = ["PeriodicEval", "eval_metrics"]

EVAL_SEED_OFFSET = 7_777_777  # eval samples never share seeds with the step's rollouts


def eval_metrics(report: dict[str, Any], ks: Sequence[int]) -> dict[str, float | None]:
    """The report's numbers that go into metrics.jsonl, under `eval/`."""
    n = report["samples_per_problem"]
    keys = [f"pass@{k}" for k in ks] + [f"avg@{n}", f"maj@{n}", "truncation_ratio", "response_len_mean"]
    return {f"eval/{key}": report[key] for key in keys}  # its time: the step's time_eval_s


class PeriodicEval:
    def __init__(
        self,
        cfg: Config,
        clients: Sequence[EngineAPI],
        tokenizer: Any,
        event_loop: asyncio.AbstractEventLoop,
        run_dir: Path,
    ) -> None:
        self.cfg, self.clients, self.tokenizer, self.event_loop = cfg, clients, tokenizer, event_loop
        self.directory = Path(run_dir) / "eval"
        self.problems = eval_problems(cfg)  # a data problem stops the run before its first step
        self.grader = get_grader(cfg.eval.grader, reward=cfg.reward)
        self.ks = sorted(set(cfg.eval.k))

    def due(self, step: int) -> bool:
        return self.cfg.eval.every_steps > 0 and step % self.cfg.eval.every_steps == 0

    def run(self, step: int) -> dict[str, float | None]:
        seed = self.cfg.seed + EVAL_SEED_OFFSET + step if self.cfg.engine.reproducible_sampling else None
        report = evaluate_on_engines(
            self.cfg, self.problems, self.clients, self.tokenizer, self.grader, self.event_loop, seed
        )
        report["step"] = step
        write_report(report, self.directory, f"step_{step:08d}.json")
        return eval_metrics(report, self.ks)

    def close(self) -> None:
        close = getattr(self.grader, "close", None)
        if close is not None:
            close()
