"""Training's own eval: every `eval.every_steps` steps, right after the weight sync, rank 0 samples the
recipe's eval set on the rollout engines (which now hold that step's weights) and the step's line of
metrics.jsonl gets `eval/pass@k` (the recipe's `eval.k`), `eval/avg@n`, `eval/maj@n`,
`eval/truncation_ratio`, `eval/response_len_mean` (with a chat format's split, `eval/no_answer_fraction`,
`eval/reasoning_len_mean`, `eval/answer_len_mean`; with tools, `eval/calls_per_problem`, `eval/turns_mean`,
the tool errors and `eval/finish/<reason>`), and the grading's `eval_grader_timeouts`,
`eval_grader_errors`, `eval_grader_restarts` (counts, kept out of `eval/` and its score plot); the full
report goes to `<run.dir>/eval/step_<N>.json`. The grader runs in its own worker pool (`eval_grader`),
so a response that would take a grader minutes costs `reward.timeout_s`, not the step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsv4rl.config.schema import Config
from dsv4rl.eval.data import eval_problems
from dsv4rl.eval.run import eval_grader, evaluate_on_engines, write_report
from dsv4rl.eval.tools import TOOL_METRIC_KEYS
from dsv4rl.eval.weights import training_weights
from dsv4rl.wire.engine_api import EngineAPI

__all__ = ["PeriodicEval", "eval_metrics"]

EVAL_SEED_OFFSET = 7_777_777  # eval samples never share seeds with the step's rollouts
SPLIT_KEYS = ("no_answer_fraction", "reasoning_len_mean", "answer_len_mean")


def eval_metrics(report: dict[str, Any], ks: Sequence[int]) -> dict[str, float | None]:
    """The report's numbers that go into metrics.jsonl, under `eval/`."""
    n = report["samples_per_problem"]
    keys = [f"pass@{k}" for k in ks] + [f"avg@{n}", f"maj@{n}", "truncation_ratio", "response_len_mean"]
    keys += [key for key in SPLIT_KEYS if key in report]  # data.chat_format=deepseek_v4's split
    keys += [key for key in TOOL_METRIC_KEYS if key in report]  # rollout.mode tools / env (eval.tools)
    metrics: dict[str, float | None] = {f"eval/{key}": report[key] for key in keys}  # time: time_eval_s
    grading = report.get("grading")
    if grading is not None:
        metrics |= {f"eval_grader_{key}": grading[key] for key in ("timeouts", "errors", "restarts")}
    return metrics


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
        self.grader = eval_grader(cfg)  # its pool starts on the first eval and lives as long as the run
        self.ks = sorted(set(cfg.eval.k))

    def due(self, step: int) -> bool:
        return self.cfg.eval.every_steps > 0 and step % self.cfg.eval.every_steps == 0

    def run(self, step: int) -> dict[str, float | None]:
        seed = self.cfg.seed + EVAL_SEED_OFFSET + step if self.cfg.engine.reproducible_sampling else None
        report = evaluate_on_engines(
            self.cfg, self.problems, self.clients, self.tokenizer, self.grader, self.event_loop, seed
        )
        report["step"] = step
        report["weights"] = training_weights(self.directory.parent, step)
        write_report(report, self.directory, f"step_{step:08d}.json")
        return eval_metrics(report, self.ks)

    def close(self) -> None:
        close = getattr(self.grader, "close", None)
        if close is not None:
            close()
