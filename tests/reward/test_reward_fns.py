"""Reward functions from the recipe (`reward.fns`): targets, results, on_error, the weighted sum, groups,
async functions, and the error fraction that stops a run. Real worker processes, real files."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from dsv4rl.checks.reward import signature_problem
from dsv4rl.config.choices import RewardOnError
from dsv4rl.config.schema import RewardConfig, RewardFnConfig
from dsv4rl.reward.combine import combine, function_metrics
from dsv4rl.reward.graders import GRADERS, ArithGrader, grade_responses
from dsv4rl.reward.inputs import RewardInput
from dsv4rl.reward.results import BadResult, FnSpec, Outcome, RewardError, read_result, user_frame
from dsv4rl.reward.rewarder import RewardSet, effective_fns
from dsv4rl.targets import TargetError, load, parse, resolve

HERE = Path(__file__).resolve().parent
FNS = "user_fns.py"


def samples(answers: list[str | None], truth: str = "7") -> list[RewardInput]:
    return [
        RewardInput(prompt="3+4=", response=a or "", answer=a, ground_truth=truth, index=i, step=1)
        for i, a in enumerate(answers)
    ]


def score(cfg: RewardConfig, inputs: list[RewardInput]) -> tuple[RewardSet, list[dict[str, Outcome]]]:
    rewards = RewardSet.from_config(cfg, [HERE])
    loop = asyncio.new_event_loop()
    try:
        scored = loop.run_until_complete(rewards.score_group(inputs))
    finally:
        rewards.close()
        loop.close()
    return rewards, scored.outcomes


def fn(name: str, target: str, **options) -> RewardFnConfig:
    return RewardFnConfig(name=name, target=target if ":" in target else f"{FNS}:{target}", **options)


# ------------------------------------------------------------------------------------------- targets
def test_targets_parse_builtin_module_and_file(tmp_path: Path) -> None:
    builtin = parse("builtin:dapo", [tmp_path], GRADERS)
    assert (builtin.kind, builtin.builtin) == ("builtin", "dapo")
    assert parse("os.path:join", [tmp_path]).ref == "os.path"
    file_target = parse(f"{FNS}:ok", [tmp_path, HERE])  # the second base directory has it
    assert file_target.kind == "file" and file_target.ref == str(HERE / FNS)
    assert resolve(file_target).__name__ == "ok"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "builtin:arithmetic",
            "no builtin grader 'arithmetic' (did you mean builtin:arith?); choose one of builtin:arith",
        ),
        ("missing/file.py:score", "file 'missing/file.py' not found (looked for"),
        ("not a target", "is not of the form builtin:<grader>, pkg.module:function"),
    ],
)
def test_a_bad_target_names_the_fix(spec: str, message: str) -> None:
    with pytest.raises(TargetError, match=re.escape(message)):
        parse(spec, [HERE], GRADERS, builtin_noun="grader")


def test_a_misspelled_module_or_function_is_named() -> None:
    with pytest.raises(TargetError, match="no module 'dsv4rl_no_such_module' on the Python path"):
        load("dsv4rl_no_such_module:score", [HERE])
    with pytest.raises(
        TargetError,
        match=r"has no function 'okk' \(its functions: .*ok.*; did you mean 'ok'\?\); fix the name",
    ):
        load(f"{FNS}:okk", [HERE])


def test_signature_must_take_the_sample_and_the_kwargs() -> None:
    functions = {name: load(f"{FNS}:{name}", [HERE]) for name in ("ok", "sleepy", "no_sample")}
    assert signature_problem(functions["ok"], {}, group=False) is None
    assert signature_problem(functions["sleepy"], {"delay": 1}, group=False) is None
    problem = signature_problem(functions["ok"], {"delay": 1}, group=False)
    assert (
        problem.startswith("ok(sample: ")
        and "unknown keyword argument 'delay' (it takes no keyword" in problem
    )
    assert "drop it from the recipe's kwargs, or give it a parameter (delay=...)" in problem
    assert "**kwargs" not in problem  # a catch-all would swallow the next misspelling
    typo = signature_problem(functions["sleepy"], {"dealy": 1, "every": 2}, group=False)
    assert "unknown keyword argument 'dealy'; did you mean 'delay'? (it takes delay, every)" in typo
    assert "fix the spelling in the recipe's kwargs" in typo
    assert "def no_sample(sample: RewardInput" in signature_problem(functions["no_sample"], {}, group=False)


# ------------------------------------------------------------------------------------------- results
@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, (1.0, {})), (True, (1.0, {})), (None, (None, {})), ({"score": 0.5, "len": 3}, (0.5, {"len": 3.0})),
     ({"score": None, "len": 2}, (None, {"len": 2.0}))],
)  # fmt: skip
def test_a_result_is_a_number_a_dict_or_none(value, expected) -> None:
    assert read_result(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [("seven", "returned str 'seven'"), ({"len": 1}, "without 'score'"), (float("nan"), "finite"),
     ({"score": 1, "errors": 2}, "a name dsv4rl's counts use"), ({"score": 1, "x": "a"}, "its 'x' is str")],
)  # fmt: skip
def test_an_unusable_result_is_the_functions_error(value, message) -> None:
    with pytest.raises(BadResult, match=message):
        read_result(value)


def test_user_frame_is_the_users_file_and_line() -> None:
    text = (
        "Traceback (most recent call last):\n"
        '  File "/x/src/dsv4rl/reward/fn_pool.py", line 60, in call_target\n'
        '  File "/home/me/task/reward.py", line 12, in score\nZeroDivisionError: division by zero\n'
    )
    assert user_frame(text) == "/home/me/task/reward.py:12 in score"


# ------------------------------------------------------------------------------------------- the set
def test_the_short_form_is_one_builtin_with_weight_one() -> None:
    (only,) = effective_fns(RewardConfig(grader="dapo"))
    assert (only.name, only.target, only.weight) == ("dapo", "builtin:dapo", 1.0)
    assert effective_fns(RewardConfig(fns=[fn("ok", "ok")]))[0].name == "ok"


def test_a_builtin_scores_as_the_grader_does() -> None:
    answers = ["7", " 7 is it", "72", None, "x7", "-7"]
    cfg = RewardConfig(fns=[RewardFnConfig(name="a", target="builtin:arith")])
    _, outcomes = score(cfg, samples(answers))
    graded = grade_responses(ArithGrader(), answers, ["7"] * len(answers))
    assert [o["a"].score for o in outcomes] == graded.rewards == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_sync_group_and_async_functions_with_weights() -> None:
    cfg = RewardConfig(
        num_workers=2,
        fns=[fn("ok", "ok", weight=2.0), fn("rank", "ranks", weight=0.5, group=True),
             fn("bonus", "async_ok", weight=0.0, kwargs={"bonus": 1.0}), fn("none", "nothing", weight=1.0)],
    )  # fmt: skip
    rewards, outcomes = score(cfg, samples(["7", "8", "7", "1"]))
    assert [o["ok"].score for o in outcomes] == [1.0, 0.0, 1.0, 0.0]
    assert [o["rank"].score for o in outcomes] == [0.0, 1.0, 2.0, 3.0]
    assert all(o["bonus"].score == 2.0 and o["none"].status == "none" for o in outcomes)
    combined = combine(rewards.specs, outcomes)
    assert combined.totals == [2.0, 0.5, 3.0, 1.5] and all(combined.scored)  # weight 0 and None: not counted
    assert combined.metrics["reward/bonus/score"] == 2.0 and combined.metrics["reward/none/none"] == 4


def test_timeout_error_and_none_under_exclude() -> None:
    """The slow calls are killed at their timeout, the run goes on; the counts are in the metrics."""
    cfg = RewardConfig(
        num_workers=2,
        fns=[fn("slow", "sleepy", timeout_s=0.5, on_error="exclude"),
             fn("boom", "raises", on_error="exclude"), fn("none", "nothing", on_error="exclude")],
    )  # fmt: skip
    rewards, outcomes = score(cfg, samples(["7"] * 8))
    assert [o["slow"].status for o in outcomes] == ["timeout", "ok", "ok", "ok"] * 2
    assert [o["boom"].status for o in outcomes] == ["ok", "error"] * 4
    assert "ZeroDivisionError: raised on purpose (at " in outcomes[1]["boom"].error
    assert "user_fns.py:" in outcomes[1]["boom"].error
    combined = combine(rewards.specs, outcomes)
    # sample 1 (index 1): slow scored it; sample 0: only boom (0.5)
    assert combined.scored == [True] * 8 and combined.totals[0] == 0.5 and combined.totals[1] == 1.0
    metrics = combined.metrics
    assert (metrics["reward/slow/timeouts"], metrics["reward/boom/errors"], metrics["reward/none/none"]) == (
        2,
        4,
        8,
    )
    assert metrics["reward/slow/length"] == 1.0 and rewards.pool.restarts == 2


def test_a_sample_no_function_scores_is_excluded() -> None:
    cfg = RewardConfig(fns=[fn("none", "nothing"), fn("ok", "ok", weight=0.0)])
    rewards, outcomes = score(cfg, samples(["7", "8"]))
    combined = combine(rewards.specs, outcomes)
    assert combined.scored == [False, False] and combined.metrics["reward_excluded"] == 2


def test_zero_scores_the_failures_zero_and_a_builtin_its_incorrect() -> None:
    cfg = RewardConfig(
        incorrect=-1.0, fns=[fn("boom", "raises", on_error="zero"), fn("text", "returns_text")]
    )
    _, outcomes = score(cfg, samples(["7", "7"]))
    assert [o["boom"].score for o in outcomes] == [0.5, 0.0]
    assert outcomes[0]["text"].score == 0.0 and "returned str 'seven'" in outcomes[0]["text"].error
    spec = FnSpec("g", "builtin:arith", 1.0, RewardOnError.zero, 1.0, zero=-1.0)
    from dsv4rl.reward.combine import settle
    from dsv4rl.reward.results import TIMED_OUT

    assert settle(TIMED_OUT, spec, samples(["7"])[0]).score == -1.0


def test_fail_stops_with_the_users_file_and_line() -> None:
    cfg = RewardConfig(fns=[fn("boom", "raises", on_error="fail")])
    with pytest.raises(RewardError) as raised:
        score(cfg, samples(["7", "7"]))
    message = str(raised.value)
    assert "reward function 'boom' (user_fns.py:raises) on sample 1 of step 1" in message
    assert "ZeroDivisionError: raised on purpose" in message and f"{HERE / FNS}:" in message
    assert "on_error=fail stops the run" in message and 'File "' in message  # the traceback


def test_too_many_errors_stop_the_step_with_the_first_traceback() -> None:
    cfg = RewardConfig(max_error_fraction=0.25, fns=[fn("boom", "raises")])
    rewards, outcomes = score(cfg, samples(["7"] * 4))
    with pytest.raises(
        RewardError, match=r"2 of 4 calls this step failed \(50%, more than reward.max_error_fraction=0.25\)"
    ):
        rewards.combine(outcomes)
    assert rewards.combine(outcomes[:1] * 4).metrics["reward/boom/errors"] == 0  # no error: no stop


def test_a_group_function_of_the_wrong_length_and_a_dying_worker() -> None:
    cfg = RewardConfig(fns=[fn("short", "short_group", group=True), fn("dies", "dies")])
    _, outcomes = score(cfg, samples(["7", "8"]))
    assert all("must return a list of 2 results" in o["short"].error for o in outcomes)
    assert all(o["dies"].error.startswith("WorkerDied") for o in outcomes)


def test_an_async_function_past_its_timeout() -> None:
    _, outcomes = score(RewardConfig(fns=[fn("slow", "async_slow", timeout_s=0.2, on_error="exclude")]),
                        samples(["7"]))  # fmt: skip
    assert outcomes[0]["slow"].status == "timeout" and outcomes[0]["slow"].score is None


def test_metrics_are_means_over_the_scored_samples() -> None:
    spec = FnSpec("f", "t", 1.0, RewardOnError.zero, 1.0)
    outcomes = [
        {"f": Outcome(1.0, {"len": 2.0})},
        {"f": Outcome(None, {}, "none")},
        {"f": Outcome(0.0, {"len": 4.0})},
    ]
    metrics = function_metrics([spec], outcomes)
    assert (
        metrics["reward/f/score"] == 0.5
        and metrics["reward/f/len"] == 3.0
        and metrics["reward/f/scored"] == 2
    )
