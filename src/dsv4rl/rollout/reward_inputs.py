"""The `RewardInput`s of one prompt's generated samples: what every reward function reads, built the same
way for training's rewards (`train.rewarding`) and for an eval scored by the recipe's reward
(`eval.recipe_reward`), so a user's function sees the same fields in both."""

from __future__ import annotations

from collections.abc import Sequence

from dsv4rl.data.chat_format import user_messages
from dsv4rl.data.chat_response import ResponseParts
from dsv4rl.data.problems import Problem
from dsv4rl.reward.inputs import RewardInput
from dsv4rl.samples import Sample


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
        whole = sample.response_text if sample.trajectory is None else final_texts[offset]
        out.append(
            RewardInput.from_sample(
                sample,
                problem,
                step=step,
                index=first_index + offset,
                answer=part.answer if part is not None else whole,
                reasoning=part.reasoning if part is not None else "",
                messages=user_messages(problem.prompt) if chat else None,
            )
        )
    return out
