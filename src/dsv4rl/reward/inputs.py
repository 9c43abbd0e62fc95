"""`RewardInput`: everything a reward function may read about one sample, as one typed object.

A reward function is `def f(sample: RewardInput, **kwargs) -> float | dict | None` (or `async def`); a group
function takes the `list[RewardInput]` of one prompt's samples. The same object, as JSON (`to_json`), is
what a remote reward service receives (docs/reward_contract.md, version `CONTRACT_VERSION`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from dsv4rl.samples import Sample

if TYPE_CHECKING:
    from dsv4rl.data.problems import Problem

CONTRACT_VERSION = 1  # the remote reward contract's version (docs/reward_contract.md)


@dataclass(frozen=True)
class RewardInput:
    """One generated sample and the data row it answers.

    - `prompt`: the problem's text as the data row gives it (before any chat template); `messages`: the
      chat messages it was rendered from when `data.chat_format` is set (None otherwise).
    - `response`: the whole response text; `answer` and `reasoning`: its DeepSeek-V4 split (after a
      thinking prompt the text after `</think>`; `answer` is None when the thinking never closed, and is
      the whole response without a chat format).
    - `prompt_ids`, `response_ids`: the token ids sent and generated; `finish_reason`: "stop", "length"
      or "abort".
    - `ground_truth`: the data row's reference answer (`data.answer_key`); `metadata`: every other column
      of the data row, nested columns kept (`sample.metadata["tests"]`).
    - `step`: the training step; `index`: the sample's place in the step's batch; `group`: its prompt's
      place (samples of one prompt share it); `problem_id`: the row's id.
    - Multi-turn (`rollout.mode` tools / env): `response` is the whole trajectory's text (tool results
      included), `answer` / `reasoning` the last assistant turn's; `conversation` the chat messages of the
      whole trajectory; `turns` the assistant turns; `tool_calls` the calls made; `tool_rewards` what the
      tools or the environment gave each turn that gave something; `finish_reason` also "max_turns" or
      "tool_budget".
    """

    prompt: str
    response: str
    answer: str | None
    reasoning: str = ""
    ground_truth: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    step: int = 0
    index: int = 0
    group: int = 0
    problem_id: str = ""
    conversation: list[dict[str, Any]] | None = None
    turns: int = 1
    tool_calls: int = 0
    tool_rewards: list[float] = field(default_factory=list)

    @property
    def truncated(self) -> bool:
        """Cut off by a token cap (`algo.sampling.max_new_tokens`, or a multi-turn token budget)."""
        return self.finish_reason == "length"

    @classmethod
    def from_sample(
        cls,
        sample: Sample,
        problem: Problem,
        *,
        step: int,
        index: int,
        answer: str | None,
        reasoning: str = "",
        messages: list[dict[str, Any]] | None = None,
    ) -> RewardInput:
        """What a reward function reads of `sample`, generated for the data row `problem`: the one place a
        rollout's output becomes reward input. `answer` / `reasoning`: the last turn's split as the
        recipe's response parser made it (its whole text without a chat format); `messages`: the chat
        messages the prompt was rendered from (`data.chat_format`)."""
        trajectory = sample.trajectory
        return cls(
            prompt=problem.prompt,
            response=sample.response_text,
            answer=answer,
            reasoning=reasoning,
            ground_truth=problem.answer,
            metadata=dict(problem.metadata),
            messages=messages,
            prompt_ids=list(sample.prompt_ids),
            response_ids=list(sample.response_ids),
            finish_reason=sample.finish_reason,
            step=step,
            index=index,
            group=sample.group,
            problem_id=problem.id,
            conversation=None if trajectory is None else list(trajectory.messages),
            turns=1 if trajectory is None else len(trajectory.turns),
            tool_calls=0 if trajectory is None else trajectory.tool_calls,
            tool_rewards=[] if trajectory is None else trajectory.tool_rewards,
        )

    def to_json(self) -> dict[str, Any]:
        """The sample as the remote contract sends it (plain JSON types only)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RewardInput:
        """A sample as a remote service reads it back; keys of newer contract versions are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


def template_fields(sample: RewardInput) -> dict[str, Any]:
    """What a judge's `prompt_template` may name: every field, `answer` as text ("" when None)."""
    values = {f.name: getattr(sample, f.name) for f in fields(sample)}
    values["answer"] = sample.answer if sample.answer is not None else ""
    return values
