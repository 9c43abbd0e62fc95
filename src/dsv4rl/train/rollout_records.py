"""`run.save_rollouts: N`: every N-th step's samples to `<run.dir>/rollouts/step_<N>.jsonl`.

One JSON object per generated sample (dynamic sampling's dropped groups included, `trained: false`): the
prompt and its ids, the response, its reasoning and answer, its ids and the engine's log-probs, the finish
reason, the reference answer, each reward function's result and the total, the advantage it trained with,
and the weights that generated it. Read back by `dsv4rl rollouts` (`dsv4rl.report.rollouts`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from dsv4rl.data.chat_response import ResponseParts
from dsv4rl.data.problems import Problem
from dsv4rl.faults.files import write_text_atomic
from dsv4rl.report.rollouts import rollouts_file
from dsv4rl.reward.results import Outcome
from dsv4rl.rollout.types import Sample


def saves_rollouts(every: int, step: int) -> bool:
    return every > 0 and step % every == 0


def rollout_records(
    samples: Sequence[Sample],
    problems: Sequence[Problem],
    outcomes: Sequence[dict[str, Outcome]],
    parts: Sequence[ResponseParts] | None,
    trained: Sequence[Sample],
    step: int,
) -> list[dict]:
    """The records of a step's samples (`dsv4rl.report.rollouts.FIELDS`)."""
    kept = {id(sample) for sample in trained}
    records = []
    for index, (sample, problem, per_fn) in enumerate(zip(samples, problems, outcomes, strict=True)):
        part = parts[index] if parts is not None else None
        records.append(
            {
                "step": step,
                "index": index,
                "group": sample.group,
                "problem_id": problem.id,
                "prompt": problem.prompt,
                "prompt_ids": list(sample.prompt_ids),
                "response": sample.response_text,
                "reasoning": part.reasoning if part is not None else "",
                "answer": part.answer if part is not None else sample.response_text,
                "response_ids": list(sample.response_ids),
                "logprobs": list(sample.rollout_logprobs),
                "finish_reason": sample.finish_reason,
                "ground_truth": problem.answer,
                "rewards": {name: outcome.to_json() for name, outcome in per_fn.items()},
                "reward": sample.reward,
                "excluded": sample.excluded,
                "trained": id(sample) in kept,
                "advantage": sample.advantage if id(sample) in kept else None,
                "weight_version": sample.weight_version,
            }
        )
    return records


def write_rollouts(
    run_dir: Path,
    step: int,
    samples: Sequence[Sample],
    problems: Sequence[Problem],
    outcomes: Sequence[dict[str, Outcome]],
    parts: Sequence[ResponseParts] | None,
    trained: Sequence[Sample],
) -> Path:
    """Write the step's records at once (a reader never sees half a file)."""
    path = rollouts_file(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = rollout_records(samples, problems, outcomes, parts, trained, step)
    write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), durable=False)
    return path
