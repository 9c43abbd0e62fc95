"""Reward functions of a recipe's own task, for the eval tests (targets `eval_rewards.py:<name>`)."""


def always_one(sample, **kwargs):  # noqa: ANN001, ANN201
    """Every response is right: scored by it, every eval reaches pass@1 = 1.0."""
    return 1.0


def exact_digit(sample, **kwargs):  # noqa: ANN001, ANN201
    """1.0 when the answer is the reference, 0.0 otherwise (what the arith grader would say)."""
    return float((sample.answer or "").strip() == sample.ground_truth)


def half(sample, **kwargs):  # noqa: ANN001, ANN201
    return 0.5
