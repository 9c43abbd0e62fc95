"""Rule-based graders: response text + ground truth -> scalar reward."""

from dsv4rl.reward.graders import (
    GRADERS,
    ArithGrader,
    BoxedGrader,
    DapoGrader,
    Grader,
    MathVerifyGrader,
    get_grader,
    grade_batch,
    grader_from_config,
)

__all__ = [
    "GRADERS",
    "ArithGrader",
    "BoxedGrader",
    "DapoGrader",
    "Grader",
    "MathVerifyGrader",
    "get_grader",
    "grade_batch",
    "grader_from_config",
]
