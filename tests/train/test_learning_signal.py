"""The not-learning notice: after FLAT_STEPS steps with every group flat, once per stretch, with causes."""

from __future__ import annotations

from dsv4rl.config.compose import compose
from dsv4rl.train.learning_signal import FLAT_STEPS, FlatRewardWatch, flat_causes


def step(n: int, flat: float, reward: float = 0.0, truncated: float = 0.0) -> dict:
    return {
        "step": n,
        "reward/zero_std_fraction": flat,
        "reward_mean": reward,
        "truncated_fraction": truncated,
    }


def test_the_notice_comes_once_per_flat_stretch_and_a_gradient_resets_it() -> None:
    watch = FlatRewardWatch(compose("tiny_arith", []))
    said = [watch.observe(step(n, 1.0)) for n in range(1, 2 * FLAT_STEPS + 1)]
    assert [n for n, line in enumerate(said, 1) if line] == [FLAT_STEPS]  # within 10 steps, said once
    assert f"equal for {FLAT_STEPS} steps (to step {FLAT_STEPS}" in said[FLAT_STEPS - 1]
    assert watch.observe(step(11, 0.9)) is None  # one group with a gradient ends the stretch
    again = [watch.observe(step(n, 1.0)) for n in range(12, 12 + FLAT_STEPS)]
    assert again[-1] is not None and again.count(None) == FLAT_STEPS - 1
    assert watch.observe({"step": 1}) is None  # no such metric: nothing to judge


def test_the_causes_follow_the_numbers() -> None:
    cfg = compose("tiny_arith", ["algo.group_size=2", "algo.dynamic_sampling.enabled=true"])
    capped = " ".join(flat_causes(step(5, 1.0, reward=0.0, truncated=0.96), cfg))
    cap = cfg.algo.sampling.max_new_tokens
    assert f"96% of responses hit the response cap (algo.sampling.max_new_tokens={cap})" in capped
    assert "every response scores 0" in capped and "dsv4rl rollouts RUN_DIR" in capped
    assert "algo.group_size=2" in capped and "algo.dynamic_sampling found no informative group" in capped
    solved = flat_causes(step(5, 1.0, reward=1.0), compose("tiny_arith", []))
    assert len(solved) == 1 and "reward_mean 1" in solved[0] and "already solved" in solved[0]
