import pytest

from dsv4rl.config.schema import ArithDataConfig
from dsv4rl.data import ArithProblems, Problem
from dsv4rl.data.arith import enumerate_arith
from dsv4rl.model.tokenizer import ALPHABET


def test_enumeration_is_complete_and_correct():
    cfg = ArithDataConfig(max_operand=3, ops=["+", "-", "*"], max_answer=5)
    problems = enumerate_arith(cfg)
    expected = set()
    for a in range(4):
        for b in range(4):
            for op, v in (("+", a + b), ("-", a - b), ("*", a * b)):
                if 0 <= v <= 5:
                    expected.add((f"{a}{op}{b}=", str(v)))
    assert {(p.prompt, p.answer) for p in problems} == expected
    assert len(problems) == len(expected)
    assert Problem(prompt="2+3=", answer="5", id="2+3") in problems
    assert all(set(p.prompt) <= set(ALPHABET) and set(p.answer) <= set(ALPHABET) for p in problems)
    assert len({p.id for p in problems}) == len(problems)


def test_default_config_size():
    # 0..4 + 0..4 with answers <= 9: all 25 pairs.
    assert len(ArithProblems(ArithDataConfig(), seed=0)) == 25


@pytest.mark.parametrize(
    "cfg, needle",
    [
        (ArithDataConfig(max_answer=2.5), "max_answer must be an integer"),
        (ArithDataConfig(ops=[]), "data.arith.ops is empty"),
        (ArithDataConfig(ops=["/"]), "unsupported"),
        (ArithDataConfig(ops=["+", "+"]), "repeats"),
        (ArithDataConfig(max_operand=-1), "max_operand"),
    ],
)
def test_invalid_configs(cfg, needle):
    with pytest.raises(ValueError, match=needle):
        ArithProblems(cfg)


def test_empty_problem_set_names_the_settings():
    # 0 op 0 = 0 always fits a non-negative max_answer, so only max_answer < 0 empties the set.
    with pytest.raises(ValueError, match=r"no arithmetic problem fits.*data\.arith\.max_answer >= 0"):
        ArithProblems(ArithDataConfig(max_operand=5, ops=["-", "*"], max_answer=-1))


def test_epochs_are_seeded_permutations():
    arith = ArithProblems(ArithDataConfig(max_operand=4, ops=["+", "*"], max_answer=9), seed=7)
    e0, e1 = arith.epoch(0), arith.epoch(1)
    assert sorted(e0, key=lambda p: p.id) == sorted(arith.problems, key=lambda p: p.id)
    assert e0 != e1 and e0 != arith.problems
    assert ArithProblems(arith.cfg, seed=7).epoch(1) == e1
    assert ArithProblems(arith.cfg, seed=8).epoch(0) != e0
    it = arith.iter_epochs()
    assert [next(it) for _ in range(2 * len(arith))] == e0 + e1
    assert list(arith) == arith.problems  # plain iteration is one finite pass
