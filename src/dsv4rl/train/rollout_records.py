"""`run.save_rollouts: N`: every N-th step's samples to `<run.dir>/rollouts/step_<N>.jsonl`.

One JSON object per generated sample (dynamic sampling's dropped groups included, `trained: false`): the
prompt and its ids, the response, its reasoning and answer, its ids and the engine's log-probs, the finish
reason, the reference answer, each reward function's result and the total, the advantage it trained with,
and the weights that generated it. A multi-turn sample (`rollout.mode` tools / env) also carries its turns,
its loss mask and its tool counts (`dsv4rl.train.trajectory_records`). Read back by `dsv4rl rollouts`
(`dsv4rl.report.rollouts`).
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
from dsv4rl.rollout.versions import version_spans
from dsv4rl.samples import Sample
from dsv4rl.train.trajectory_records import Decode, trajectory_fields


def saves_rollouts(every: int, step: int) -> bool:
    return every > 0 and step % every == 0


def rollout_records(
    samples: Sequence[Sample],
    problems: Sequence[Problem],
    outcomes: Sequence[dict[str, Outcome]],
    parts: Sequence[ResponseParts] | None,
    trained: Sequence[Sample],
    step: int,
    decode: Decode | None = None,
) -> list[dict]:
    """The records of a step's samples (`dsv4rl.report.rollouts.FIELDS`, and `TRAJECTORY_FIELDS` for a
    multi-turn sample; `decode`: the tokenizer's, for each turn's exact text)."""
    kept = {id(sample) for sample in trained}
    records = []
    for index, (sample, problem, per_fn) in enumerate(zip(samples, problems, outcomes, strict=True)):
        part = parts[index] if parts is not None else None
        turns = trajectory_fields(sample, decode)  # {} for a single-turn sample
        whole = turns["turns"][-1]["text"] if turns.get("turns") else sample.response_text  # the last turn
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
                "answer": part.answer if part is not None else whole,
                "response_ids": list(sample.response_ids),
                "logprobs": list(sample.rollout_logprobs),
                "finish_reason": sample.finish_reason,
                "ground_truth": problem.answer,
                "rewards": {name: outcome.to_json() for name, outcome in per_fn.items()},
                "reward": sample.reward,
                "excluded": sample.excluded,
                "trained": id(sample) in kept,
                "advantage": sample.advantage if id(sample) in kept else None,
                "weight_version": sample.weight_version,  # its first token's
                # each response token's version, as [[version, start, end], ...] ("" where inserted)
                "versions": version_spans(sample.versions),
                **turns,
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
    decode: Decode | None = None,
) -> Path:
    """Write the step's records at once (a reader never sees half a file)."""
    path = rollouts_file(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = rollout_records(samples, problems, outcomes, parts, trained, step, decode)
    write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), durable=False)
    return path
