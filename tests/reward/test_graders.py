import asyncio
import json
import logging
import pickle
import threading
import time

import pytest
from grader_rules import blocked_sleep, echo

from dataset_files import DATA
from dsv4rl.config.schema import RewardConfig
from dsv4rl.reward import GRADERS, get_grader, grade_batch, grader_from_config
from dsv4rl.reward.fn_pool import AsyncProcessPool
from dsv4rl.reward.math_verify import MathVerifyGrader
from dsv4rl.reward.normalize import last_boxed, normalize_final_answer
from dsv4rl.reward.results import TIMED_OUT

SAMPLE = DATA / "dapo_math_17k_sample300.jsonl"


@pytest.fixture(scope="module")
def mv():
    grader = get_grader("math_verify", timeout_s=5.0)
    yield grader
    grader.close()


@pytest.mark.parametrize(
    "response, ok",
    [
        ("7", True), (" 7\n", True), ("7=", True), ("7 is it", True), ("7.", True), ("7<eos>", True),
        ("", False), ("x7", False), ("+7", False), ("07", False), ("72", False), ("7.5", False),
        ("-7", False), ("seven", False), ("6", False),
    ],
)  # fmt: skip
def test_arith_grader(response, ok):
    assert get_grader("arith").grade(response, "7") == (1.0 if ok else 0.0)


def test_arith_negative_answer_and_reward_values():
    g = get_grader("arith", correct=2.0, incorrect=-1.0)
    assert g.grade("-3 ", "-3") == 2.0 and g.grade("3", "-3") == -1.0


@pytest.mark.parametrize(
    "response, truth, ok",
    [
        ("work...\nAnswer: 34", "34", True),
        ("answer:34", "34", True),  # case-insensitive, no space needed
        ("Answer: 12\nactually\nAnswer: 34", "34", True),  # the last occurrence counts
        ("Answer: 34\nAnswer: 12", "34", False),
        ("Answer: $34$", "34", True),
        ("Answer: x = 34", "34", True),  # right-hand side of '='
        ("Answer: 1,000", "1000", True),
        ("Answer: 90^\\circ", "90", True),
        ("Answer: \\boxed{34}", "34", True),
        ("Answer: \\frac12", "\\frac{1}{2}", True),
        ("Answer: 34" + "x" * 400, "34", False),  # only the last 300 characters are read
        ("Answer: 34" + "\n" + "pad " * 80, "34", False),
        ("The answer is 34", "34", False),  # no "Answer:" line
        ("Answer: 35", "34", False),
    ],
)
def test_dapo_grader(response, truth, ok):
    assert get_grader("dapo").grade(response, truth) == (1.0 if ok else 0.0)


def test_dapo_reward_values_like_dapo():
    g = grader_from_config(RewardConfig(grader="dapo", correct=1.0, incorrect=-1.0))
    assert g.grade("Answer: 5", "5") == 1.0 and g.grade("Answer: 6", "5") == -1.0


@pytest.mark.parametrize(
    "response, truth, ok",
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", True),
        ("\\boxed{1} then \\boxed{2}", "2", True),
        ("\\boxed{1} then \\boxed{2}", "1", False),
        ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", False),  # unbalanced
        ("\\boxed{1{,}000}", "1000", True),
        ("no box 5", "5", False),
    ],
)
def test_boxed_grader(response, truth, ok):
    assert get_grader("boxed").grade(response, truth) == (1.0 if ok else 0.0)


def test_normalize_and_extract_helpers():
    assert normalize_final_answer("\\text{(A) } 5 \\text{ dollars}") == "(A)5"
    assert normalize_final_answer("$\\sqrt2$") == "\\sqrt{2}"
    assert last_boxed("a \\boxed{x^{2}} b") == "x^{2}"
    assert last_boxed("\\boxed{") is None


def test_get_grader_from_reward_config():
    cfg = RewardConfig(grader="math_verify", timeout_s=3.0, correct=1.0, incorrect=-1.0)
    g = get_grader("math_verify", reward=cfg, num_workers=2)
    assert (g.timeout_s, g.incorrect, g.num_workers) == (3.0, -1.0, 2)
    assert get_grader("arith", reward=cfg, correct=5.0).grade("1", "1") == 5.0
    assert grader_from_config(RewardConfig(grader="boxed", incorrect=-1.0)).grade("", "1") == -1.0


def test_get_grader_errors():
    with pytest.raises(ValueError, match=r"grader='regex' is unknown; choose one of arith, dapo, answer"):
        get_grader("regex")
    with pytest.raises(ValueError, match=r"does not take \['timeout_s'\]"):
        get_grader("dapo", timeout_s=3)
    assert set(GRADERS) == {"arith", "dapo", "answer_line", "boxed", "math_verify"}
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        grade_batch(get_grader("arith"), ["1", "2"], ["1"])


def test_grade_batch_without_batched_path():
    assert grade_batch(get_grader("arith"), ["1", "2", "x"], ["1", "3", "x"]) == [1.0, 0.0, 0.0]


def _dapo_rows():
    if not SAMPLE.is_file():
        pytest.skip(f"{SAMPLE} not present: set DSV4RL_DATA_DIR to the data sets' directory")
    return [json.loads(line)["reward_model"]["ground_truth"] for line in SAMPLE.read_text().splitlines()]


@pytest.mark.parametrize("name", ["dapo", "math_verify"])
def test_answer_line_on_dapo_sample(name, mv):
    truths = _dapo_rows()
    grader = mv if name == "math_verify" else get_grader(name)
    right = grade_batch(grader, [f"Let me think.\nAnswer: {t}" for t in truths], truths)
    wrong = grade_batch(grader, [f"Let me think.\nAnswer: {int(t) + 1}" for t in truths], truths)
    assert right == [1.0] * len(truths)
    assert wrong == [0.0] * len(truths)


@pytest.mark.parametrize("name", ["boxed", "math_verify"])
def test_boxed_on_dapo_sample(name, mv):
    truths = _dapo_rows()
    grader = mv if name == "math_verify" else get_grader(name)
    right = grade_batch(grader, [f"So the result is $\\boxed{{{t}}}$." for t in truths], truths)
    wrong = grade_batch(grader, [f"So the result is $\\boxed{{{int(t) + 1}}}$." for t in truths], truths)
    assert right == [1.0] * len(truths)
    assert wrong == [0.0] * len(truths)


def test_math_verify_equivalences(mv):
    responses = [
        "$\\boxed{\\frac{1}{2}}$",
        "$\\boxed{0.5}$",
        "$\\boxed{\\frac{2}{3}}$",
        "Answer: $(3, \\pi/2)$",
    ]
    truths = ["\\frac{1}{2}", "\\frac{1}{2}", "\\frac{1}{2}", "\\left( 3, \\frac{\\pi}{2} \\right)"]
    assert mv.grade_many(responses, truths) == [1.0, 1.0, 0.0, 1.0]


def test_math_verify_from_a_worker_thread():
    # The grader is created and first used (workers started) off the main thread, where math-verify's
    # own signal-based timeout would raise.
    out = {}

    def run():
        grader = get_grader("math_verify", timeout_s=5.0)
        try:
            out["r"] = grade_batch(
                grader, ["Answer: 12", "Answer: 13", "$\\boxed{\\frac{3}{6}}$"], ["12", "12", "1/2"]
            )
        except BaseException as e:  # surface the failure in the main thread
            out["r"] = e
        finally:
            grader.close()

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=60)
    assert out["r"] == [1.0, 0.0, 1.0]


def test_math_verify_slow_call_times_out_with_warning(caplog):
    # 9^(9^9) against 1: sympy tries to evaluate a number with ~370 million digits.
    grader = MathVerifyGrader(timeout_s=1.0, incorrect=-1.0)
    try:
        grader.grade("warm", "1")  # start the worker before timing
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="dsv4rl.reward.fn_pool"):
            rewards = grade_batch(grader, ["$\\boxed{9^{9^{9}}}$", "Answer: 4"], ["1", "4"])
        assert time.monotonic() - start < 10
        assert rewards == [-1.0, 1.0]
        assert any("took over 1.0 s" in r.getMessage() for r in caplog.records)
        assert grader.restarts == 0  # the worker's own alarm stopped it
    finally:
        grader.close()


def test_pool_kills_a_worker_that_ignores_the_alarm(caplog):
    pool = AsyncProcessPool(1, label="grader blocked")
    loop = asyncio.new_event_loop()

    def run(fn, calls):
        async def gather():
            return await asyncio.gather(*(pool.call(fn, call, 0.5, grace_s=0.5) for call in calls))

        return loop.run_until_complete(gather())

    try:
        loop.run_until_complete(pool.start())
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="dsv4rl.reward.fn_pool"):
            out = run(blocked_sleep, [(0.0,), (60.0,), (0.0,)])
        assert time.monotonic() - start < 20
        assert out == ["finished", TIMED_OUT, "finished"]
        # Each call has its own deadline: only the stuck call's worker is killed, once; the call after it
        # runs again on the fresh worker.
        assert (pool.restarts, pool.timeouts) == (1, 1)
        assert any(
            "did not stop at its alarm: its worker was killed" in r.getMessage() for r in caplog.records
        )
        assert run(echo, [(1,), (2,)]) == [1, 2]  # the fresh worker works
    finally:
        pool.close()
        loop.close()


def test_math_verify_grader_pickles():
    grader = get_grader("math_verify", timeout_s=2.0, correct=3.0)
    copy = pickle.loads(pickle.dumps(grader))
    assert (copy.timeout_s, copy.correct, copy.num_workers) == (2.0, 3.0, 1)
