"""Rewards: the rule graders, and a recipe's own reward functions (`reward.fns`, docs/tasks.md), each
reading one `RewardInput`."""

from dsv4rl.reward.graders import (
    GRADERS,
    ArithGrader,
    BoxedGrader,
    DapoGrader,
    Grader,
    get_grader,
    grade_batch,
    grader_from_config,
)
from dsv4rl.reward.inputs import CONTRACT_VERSION, RewardInput

__all__ = [
    "CONTRACT_VERSION",
    "RewardInput",
    "GRADERS",
    "ArithGrader",
    "BoxedGrader",
    "DapoGrader",
    "Grader",
    "get_grader",
    "grade_batch",
    "grader_from_config",
]
