"""The eval sets: their problems, hold-outs, templates, and the errors that name the fix."""

from __future__ import annotations

import pytest

from dataset_files import DATA, needs_data
from dsv4rl.config.compose import compose
from dsv4rl.data.datasets import DAPO_TEMPLATE, problem_source
from dsv4rl.eval.data import EvalDataError, eval_problems


def eval_config(name: str, *overrides: str):
    return compose("tiny_arith", [f"eval={name}", *overrides])


@needs_data
def test_aime24_has_30_problems_asked_as_the_bare_problem() -> None:
    """The reference run's eval asked AIME's problem as the user turn, no instruction (docs/reference_run.md);
    eval.prompt_template=dapo asks it with DAPO-Math's."""
    problems = eval_problems(eval_config("aime24", f"eval.dataset={DATA / 'aime24.jsonl'}"))
    assert len(problems) == 30 and problems[0].id == "2024-I-1" and problems[-1].id == "2024-II-15"
    assert problems[0].prompt.startswith("Every morning Aya goes for a $9$-kilometer-long walk")
    dapo = eval_problems(
        eval_config("aime24", f"eval.dataset={DATA / 'aime24.jsonl'}", "eval.prompt_template=dapo")
    )
    assert dapo[0].prompt.startswith(DAPO_TEMPLATE.split("{problem}")[0])
    assert dapo[0].prompt.endswith(DAPO_TEMPLATE.split("{problem}")[1])


@needs_data
@pytest.mark.parametrize(
    ("name", "file", "count"), [("math500", "math500.jsonl", 500), ("gsm8k", "gsm8k_test.jsonl", 1319)]
)
def test_math500_and_gsm8k(name: str, file: str, count: int) -> None:
    problems = eval_problems(eval_config(name, f"eval.dataset={DATA / file}"))
    assert len(problems) == count and all(p.answer for p in problems)


@needs_data
def test_dapo_holdout_is_the_last_rows_and_training_never_sees_them() -> None:
    file = DATA / "dapo_math_17k_sample300.jsonl"
    cfg = compose(
        "dapo_math",
        [
            f"data.path={file}",
            "eval=dapo_math_holdout",
            f"eval.dataset={file}",
            "eval.holdout=40",
            "data.holdout=40",
        ],
    )
    held = eval_problems(cfg)
    trained = problem_source(cfg.data)
    assert len(held) == 40 and len(trained) == 260
    assert not {p.id for p in held} & {p.id for p in trained}


def test_tiny_arith_eval_is_every_arith_problem_and_max_problems_cuts() -> None:
    assert len(eval_problems(eval_config("tiny_arith"))) == 16
    assert [p.id for p in eval_problems(eval_config("tiny_arith", "eval.max_problems=3"))] == [
        "0+0",
        "0+1",
        "0+2",
    ]


def test_a_hub_name_offline_says_how_to_pass_a_file() -> None:
    cfg = eval_config("aime24", "eval.dataset=hf:HuggingFaceH4/aime_2024")
    with pytest.raises(EvalDataError, match=r"hf:HuggingFaceH4/aime_2024 .*pass data.path=<file>"):
        eval_problems(cfg)
