"""The `RewardInput`s of one prompt's generated samples: what every reward function reads, built the same
way for training's rewards (`train.rewarding`) and for an eval scored by the recipe's reward
(`eval.recipe_reward`), so a user's function sees the same fields in both."""

from __future__ import annotations

from collections.abc import Sequence

from dsv4rl.data.chat_format import user_messages
from dsv4rl.data.chat_response import ResponseParts
from dsv4rl.data.problems import Problem
from dsv4rl.reward.inputs import RewardInput
from dsv4rl.rollout.types import Sample


def reward_inputs(
    problem: Problem,
    samples: Sequence[Sample],
    parts: Sequence[ResponseParts] | None,
    step: int,
    first_index: int,
    chat: bool,
    final_texts: Sequence[str] = (),
) -> list[RewardInput]:
    """The `RewardInput`s of one prompt's samples (`first_index`: the first one's index in the step;
    `final_texts`: each multi-turn sample's last turn as text, its answer without a chat format)."""
    out = []
    for offset, sample in enumerate(samples):
        part = parts[offset] if parts is not None else None
        trajectory = sample.trajectory
        whole = sample.response_text if trajectory is None else final_texts[offset]
        out.append(
            RewardInput(
                prompt=problem.prompt,
                response=sample.response_text,
                answer=part.answer if part is not None else whole,
                reasoning=part.reasoning if part is not None else "",
                ground_truth=problem.answer,
                metadata=dict(problem.metadata),
                messages=user_messages(problem.prompt) if chat else None,
                prompt_ids=list(sample.prompt_ids),
                response_ids=list(sample.response_ids),
                finish_reason=sample.finish_reason,
                step=step,
                index=first_index + offset,
                group=sample.group,
                problem_id=problem.id,
                conversation=None if trajectory is None else list(trajectory.messages),
                turns=1 if trajectory is None else len(trajectory.turns),
                tool_calls=0 if trajectory is None else trajectory.tool_calls,
                tool_rewards=[] if trajectory is None else trajectory.tool_rewards,
            )
        )
    return out
