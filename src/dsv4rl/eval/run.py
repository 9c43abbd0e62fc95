"""One evaluation: generate n samples per problem on the engines (or take saved responses), grade them in
the grader's pool, score them, and build the report (`dsv4rl eval`, and training's periodic eval).

The report is a plain dict, written as JSON: the headline scores at its top level (`pass@1`, `pass@2`,
..., `avg@n`, `maj@n`, `truncation_ratio`, `response_len_mean`), then what was evaluated and how (with
`chat_format=deepseek_v4`: `no_answer_fraction`, `reasoning_len_mean`, `answer_len_mean`), where
the time went, the per-problem table, and the problems that could not be scored (saved responses with
unknown ids, problems without responses).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dsv4rl.aio import run_on
from dsv4rl.config.choices import ChatFormat, EvalScoredBy
from dsv4rl.config.schema import Config, EvalConfig
from dsv4rl.data.chat_format import PromptRenderer, eval_chat_settings
from dsv4rl.data.chat_response import ResponseParser, response_split_metrics, split_saved_response
from dsv4rl.data.problems import Problem
from dsv4rl.eval.data import eval_problems
from dsv4rl.eval.recipe_reward import RecipeReward
from dsv4rl.eval.scores import ProblemResult, problem_row, score_problems
from dsv4rl.eval.tools import eval_multi_turn, final_texts, generate_with_tools, tool_report
from dsv4rl.reward.graders import DEFAULT_MAX_ERROR_FRACTION, Graded, Grader, get_grader, grade_responses
from dsv4rl.rollout.generate import generate_samples
from dsv4rl.samples import Sample
from dsv4rl.wire.engine_api import EngineAPI

__all__ = [
    "REPORT_FILE",
    "ResponsesError",
    "eval_grader",
    "evaluate_on_engines",
    "evaluate_responses",
    "evaluate_saved",
    "grader_fields",
    "write_report",
]

REPORT_FILE = "eval.json"


class ResponsesError(ValueError):
    """A saved-responses file that cannot be graded; the message names the line and the fix."""


def eval_grader(cfg: Config) -> Grader | RecipeReward:
    """The eval set's grader in a worker pool: every call (the answers maj@n votes on too) under
    `reward.timeout_s`, in `reward.num_workers` processes, so no response can stall an eval. With
    `eval.scored_by: recipe`, the recipe's reward instead (`RecipeReward`, isolated as in training)."""
    if cfg.eval.scored_by == EvalScoredBy.recipe:
        return RecipeReward(cfg)
    return get_grader(cfg.eval.grader, reward=cfg.reward, pooled=True)


def grader_fields(cfg: EvalConfig, grader: Grader | RecipeReward) -> dict[str, Any]:
    """What the report says scored it: `grader` (the eval set's grader's name, or the recipe's functions
    with their weights) and `scored_by` (eval_set | recipe)."""
    if isinstance(grader, RecipeReward):
        return grader.report_fields()
    return {"grader": cfg.grader, "scored_by": EvalScoredBy.eval_set.value}


def grade_results(
    problems: Sequence[Problem],
    responses: Sequence[Sequence[str]],
    grader: Grader,
    samples: Sequence[Sequence[Sample]] | None = None,
    max_error_fraction: float = DEFAULT_MAX_ERROR_FRACTION,
    answer_parts: Sequence[Sequence[str | None]] | None = None,
) -> tuple[list[ProblemResult], float, Graded]:
    """Grade every response and read its final answer (one pool round for all of them) -> results,
    the seconds grading took, and the grading's timeouts and errors. `answer_parts` (a chat format's
    split): what the grader reads instead of the whole response; None there, no answer (incorrect)."""
    graded_texts = answer_parts if answer_parts is not None else responses
    flat = [text for texts in graded_texts for text in texts]
    answers = [p.answer for p, texts in zip(problems, responses, strict=True) for _ in texts]
    start = time.monotonic()
    graded = grade_responses(grader, flat, answers, answers=True, max_error_fraction=max_error_fraction)
    seconds = time.monotonic() - start
    grades, final_answers = graded.rewards, graded.answers or []
    correct_value = getattr(grader, "correct", 1.0)
    results, at = [], 0
    for index, (problem, texts) in enumerate(zip(problems, responses, strict=True)):
        mine, stated = grades[at : at + len(texts)], final_answers[at : at + len(texts)]
        at += len(texts)
        sampled = samples[index] if samples is not None else None
        results.append(
            ProblemResult(
                id=problem.id,
                answer=problem.answer,
                correct=[g == correct_value for g in mine],
                final_answers=stated,
                lengths=[len(s.response_ids) for s in sampled] if sampled is not None else None,
                truncated=[s.truncated for s in sampled] if sampled is not None else None,
                responses=list(texts),
            )
        )
    return results, seconds, graded


def build_report(
    cfg: EvalConfig,
    results: list[ProblemResult],
    seconds: dict[str, float],
    sampled: bool,
    graded: Graded,
    **extra: Any,
) -> dict[str, Any]:
    return {
        **score_problems(results),
        "eval": cfg.name,
        "dataset": cfg.dataset,
        "sampling": asdict(cfg.sampling) if sampled else None,  # saved responses: not sampled here
        "seconds": seconds,
        "grading": graded.summary(),  # timeouts, errors by exception type, pool restarts
        **extra,
        "per_problem": [problem_row(r) for r in results],
    }


def evaluate_on_engines(
    cfg: Config,
    problems: Sequence[Problem],
    clients: Sequence[EngineAPI],
    tokenizer: Any,
    grader: Grader | RecipeReward,
    event_loop: asyncio.AbstractEventLoop,
    seed: int | None,
) -> dict[str, Any]:
    """`cfg.eval.samples_per_problem` samples of every problem from the engines, graded and scored; with
    `rollout.mode` tools / env, trajectories with the recipe's tools, the last turn graded (eval.tools)."""
    e = cfg.eval
    multi = eval_multi_turn(cfg, tokenizer)
    renderer = multi.renderer if multi is not None else PromptRenderer(tokenizer, eval_chat_settings(cfg))
    start = time.monotonic()
    if multi is not None:
        samples = generate_with_tools(multi, clients, problems, e.samples_per_problem, event_loop, seed)
    else:
        samples = run_on(
            event_loop,
            generate_samples(
                clients, problems, tokenizer, e.samples_per_problem, e.sampling, seed=seed, renderer=renderer
            ),
        )
    generate_s = time.monotonic() - start
    by_problem = [
        samples[i * e.samples_per_problem : (i + 1) * e.samples_per_problem] for i in range(len(problems))
    ]
    responses = [[s.response_text for s in group] for group in by_problem]
    finals = [final_texts(renderer, group) for group in by_problem]  # single turn: the responses
    answer_parts, split, parts = (finals if multi is not None else None), {}, None
    if renderer.settings.is_chat:  # graders read the answer part
        parser = ResponseParser(renderer)
        parts = [
            [parser.parse(s.final_turn_ids, text) for s, text in zip(group, texts, strict=True)]
            for group, texts in zip(by_problem, finals, strict=True)
        ]
        answer_parts = [[part.answer for part in group] for group in parts]
        split = response_split_metrics([part for group in parts for part in group])
    if multi is not None:
        split = {**split, "rollout_mode": cfg.rollout.mode.value, **tool_report(samples)}
    if isinstance(grader, RecipeReward):
        results, grade_s, graded, fn_means = grader.grade(
            problems, responses, event_loop, by_problem, parts, final_texts=finals
        )
        split = {**split, "reward_functions": fn_means}
    else:
        results, grade_s, graded = grade_results(
            problems, responses, grader, by_problem, cfg.reward.max_error_fraction, answer_parts
        )
    return build_report(
        e,
        results,
        {"generate": generate_s, "grade": grade_s},
        True,
        graded,
        **grader_fields(e, grader),
        chat_format=renderer.settings.format.value,
        thinking=renderer.settings.thinking,
        **split,
        engines=[getattr(c, "base_url", str(c)) for c in clients],
        unknown_ids=[],
        missing=[],
    )


def read_responses(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line number, id, responses) of every line of a saved-responses file."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ResponsesError(
                f'{where}: not JSON ({exc.msg}); each line is {{"id": ..., "responses": [...]}}'
            ) from None
        if not isinstance(record, dict) or "id" not in record or "responses" not in record:
            raise ResponsesError(
                f'{where}: expected {{"id": ..., "responses": ["...", ...]}}, got {line[:80]!r}'
            )
        texts = record["responses"]
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ResponsesError(f"{where}: responses must be a list of strings")
        rows.append((number, str(record["id"]), texts))
    return rows


def evaluate_responses(
    cfg: EvalConfig,
    problems: Sequence[Problem],
    path: Path,
    grader: Grader | RecipeReward,
    max_error_fraction: float = DEFAULT_MAX_ERROR_FRACTION,
    chat_format: ChatFormat = ChatFormat.none,
) -> dict[str, Any]:
    """Grade saved generations. Ids must match the data set's; unknown ids and problems without
    responses are listed in the report (`unknown_ids`, `missing`), never dropped silently. With
    `chat_format=deepseek_v4` a response that closes a thinking block is graded on what follows it."""
    rows = read_responses(path)
    known = {p.id: p for p in problems}
    given: dict[str, list[str]] = {}
    unknown = []
    for number, pid, texts in rows:
        if pid not in known:
            unknown.append({"line": number, "id": pid})
        else:
            given.setdefault(pid, []).extend(texts)
    missing = [p.id for p in problems if not given.get(p.id)]
    graded = [p for p in problems if given.get(p.id)]
    if not graded:
        raise ResponsesError(
            f"{path}: no line matches a problem of eval {cfg.name!r} (its ids look like "
            f"{[p.id for p in problems[:3]]}; {len(unknown)} unknown id(s), "
            f"e.g. {[u['id'] for u in unknown[:3]]})"
        )
    counts = sorted({len(given[p.id]) for p in graded})
    if len(counts) > 1:
        raise ResponsesError(
            f"{path}: problems have different numbers of responses ({counts}); pass@k needs the same n "
            "for every problem"
        )
    texts = [given[p.id] for p in graded]
    answer_parts, split = None, {}
    if chat_format != ChatFormat.none:
        answer_parts = [[split_saved_response(text)[1] for text in group] for group in texts]
        split = {"chat_format": chat_format.value}
    if isinstance(grader, RecipeReward):
        results, grade_s, grading, fn_means = grader.grade(graded, texts, answer_parts=answer_parts)
        split = {**split, "reward_functions": fn_means}
    else:
        results, grade_s, grading = grade_results(
            graded, texts, grader, None, max_error_fraction, answer_parts
        )
    return build_report(
        cfg,
        results,
        {"grade": grade_s},
        False,
        grading,
        **grader_fields(cfg, grader),
        **split,
        responses_file=str(path),
        unknown_ids=unknown,
        missing=missing,
    )


def write_report(report: dict[str, Any], directory: Path, name: str = REPORT_FILE) -> Path:
    """Atomically (a reader never sees half a report)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    partial = directory / f".{name}.tmp"
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(path)
    return path


def evaluate_saved(cfg: Config, responses: Path, run_dir: Path) -> dict[str, Any]:
    """`dsv4rl eval --responses FILE`: the eval set's saved generations graded, no engine started; the
    report is written to `run_dir`."""
    grader = eval_grader(cfg)
    try:
        report = evaluate_responses(
            cfg.eval,
            eval_problems(cfg),
            responses,
            grader,
            cfg.reward.max_error_fraction,
            eval_chat_settings(cfg).format,
        )
    finally:
        getattr(grader, "close", lambda: None)()
    report["weights"] = {"kind": "responses", "responses_file": str(responses.resolve())}
    write_report(report, run_dir)
    return report
