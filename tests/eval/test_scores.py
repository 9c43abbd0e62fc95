"""pass@k, avg@n and maj@n against brute force."""

from __future__ import annotations

from itertools import combinations

import pytest

from dsv4rl.eval.scores import ProblemResult, majority_correct, pass_ks, score_problems


def brute_force_pass_at_k(correct: list[bool], k: int) -> float:
    """The share of k-subsets of the n samples with at least one correct sample."""
    subsets = list(combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_equals_enumeration_over_subsets(n: int) -> None:
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        result = ProblemResult("p", "1", correct, ["1"] * n)
        scores = score_problems([result])
        for k in pass_ks(n):
            assert scores[f"pass@{k}"] == pytest.approx(brute_force_pass_at_k(correct, k), abs=1e-12)


def test_scores_average_over_problems() -> None:
    a = ProblemResult(
        "a", "1", [True, False, False, False], ["1", "2", "2", None], [3, 4, 5, 6], [0, 0, 0, 1]
    )
    b = ProblemResult("b", "5", [True, True, True, False], ["5", "5", "5", "6"], [1, 1, 1, 1], [0, 0, 0, 0])
    scores = score_problems([a, b])
    assert scores["pass@1"] == pytest.approx((0.25 + 0.75) / 2)
    assert scores["pass@2"] == pytest.approx((brute_force_pass_at_k(a.correct, 2) + 1.0) / 2)
    assert scores["avg@4"] == pytest.approx(0.5)
    assert scores["maj@4"] == 0.5  # a's majority answer "2" is wrong, b's "5" right
    assert scores["truncation_ratio"] == pytest.approx(1 / 8)
    assert scores["response_len_mean"] == pytest.approx(22 / 8)
    assert (scores["problems"], scores["samples_per_problem"]) == (2, 4)
    assert list(k for k in scores if k.startswith("pass@")) == ["pass@1", "pass@2", "pass@4"]


def test_pass_ks_are_powers_of_two_and_n() -> None:
    assert pass_ks(1) == [1]
    assert pass_ks(8) == [1, 2, 4, 8]
    assert pass_ks(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="at least one sample"):
        pass_ks(0)


def test_majority_vote_ties_go_to_the_first_answer_seen_and_silence_is_wrong() -> None:
    assert majority_correct(["3", "4", "4", "3"], [True, False, False, True])  # tie: "3" seen first
    assert not majority_correct(["4", "3", "3", "4"], [False, True, True, False])
    assert majority_correct([None, None, "7"], [False, False, True])
    assert not majority_correct([None, None], [False, False])


def test_unequal_sample_counts_are_refused() -> None:
    a = ProblemResult("a", "1", [True], ["1"])
    b = ProblemResult("b", "1", [True, False], ["1", "2"])
    with pytest.raises(ValueError, match=r"same number of samples.*\[1, 2\]"):
        score_problems([a, b])
    with pytest.raises(ValueError, match="no graded problems"):
        score_problems([])


def test_training_metrics_take_the_recipe_ks_under_eval() -> None:
    from dsv4rl.eval.periodic import eval_metrics

    result = ProblemResult(
        "a", "1", [True, False, False, False], ["1", "2", "2", "2"], [1, 1, 1, 1], [0, 0, 0, 1]
    )
    report = score_problems([result])
    assert eval_metrics(report, [1, 4]) == {
        "eval/pass@1": 0.25,
        "eval/pass@4": 1.0,
        "eval/avg@4": 0.25,
        "eval/maj@4": 0.0,
        "eval/truncation_ratio": 0.25,
        "eval/response_len_mean": 1.0,
    }
