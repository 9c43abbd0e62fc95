import json
from pathlib import Path

import pytest

from dataset_files import DATA, needs_data
from dsv4rl.config.schema import ArithDataConfig, DataConfig
from dsv4rl.data import (
    ArithProblems,
    DatasetError,
    Problem,
    load_file_problems,
    load_problems,
    problem_source,
)
from dsv4rl.data.datasets import DAPO_TEMPLATE, gsm8k_final_answer


@needs_data
def test_dapo_sample_jsonl():
    problems = load_problems("dapo_math", DATA / "dapo_math_17k_sample300.jsonl")
    assert len(problems) == 300
    first = problems[0]
    assert first.id == "svs-0" and first.answer == "34"
    assert first.prompt.startswith("Solve the following math problem step by step.")
    assert "In triangle $ABC$" in first.prompt
    assert all(p.answer.lstrip("-").isdigit() for p in problems)


@needs_data
def test_dapo_parquet_matches_jsonl_sample():
    pytest.importorskip("pyarrow")
    full = load_problems("dapo_math", DATA / "dapo_math_17k.parquet")
    assert len(full) == 17917
    assert full[:300] == load_problems("dapo_math", DATA / "dapo_math_17k_sample300.jsonl")


@needs_data
def test_eval_sets():
    aime = load_problems("aime24", DATA / "aime24.jsonl")
    assert len(aime) == 30 and aime[0].id == "2024-I-1" and aime[0].answer == "204"
    math500 = load_problems("math500", DATA / "math500.jsonl")
    assert len(math500) == 500
    assert math500[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert math500[0].id == "test/precalculus/807.json"
    gsm = load_problems("gsm8k", DATA / "gsm8k_test.jsonl")
    assert len(gsm) == 1319 and gsm[0].answer == "18" and gsm[0].prompt.startswith("Janet")
    assert gsm[0].id == "gsm8k-0"
    wrapped = load_problems("aime24", DATA / "aime24.jsonl", template=DAPO_TEMPLATE, limit=2)
    assert len(wrapped) == 2 and wrapped[0].prompt.endswith('own line after "Answer:".')
    assert aime[0].prompt in wrapped[0].prompt


def test_gsm8k_answer_extraction():
    assert gsm8k_final_answer("so 3 + 4 = 7\n#### 1,234") == "1234"
    assert gsm8k_final_answer("no marker") is None
    assert gsm8k_final_answer("#### ") is None


def _write(tmp_path: Path, rows: list, name="d.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD_DAPO = {
    "prompt": [{"role": "user", "content": "What is 1+1?"}],
    "reward_model": {"ground_truth": "2"},
    "extra_info": {"index": "a"},
}


@pytest.mark.parametrize(
    "bad_row, field, expected",
    [
        ("{not json", None, "invalid JSON"),
        ([1, 2], None, "expected a JSON object"),
        ({"reward_model": {"ground_truth": "2"}}, "prompt", "missing"),
        ({**GOOD_DAPO, "prompt": [{"role": "assistant", "content": "x"}]}, "prompt", "chat list"),
        ({**GOOD_DAPO, "prompt": ""}, "prompt", "non-empty string"),
        ({**GOOD_DAPO, "reward_model": {}}, "reward_model.ground_truth", "missing"),
        (
            {**GOOD_DAPO, "reward_model": {"ground_truth": ["2"]}},
            "reward_model.ground_truth",
            "got \\['2'\\]",
        ),
        ({**GOOD_DAPO, "reward_model": {"ground_truth": "  "}}, "reward_model.ground_truth", "non-empty"),
    ],
)
def test_malformed_rows_name_file_line_and_field(tmp_path, bad_row, field, expected):
    path = _write(tmp_path, [GOOD_DAPO, "", bad_row])  # the bad row is on line 3
    with pytest.raises(DatasetError, match=expected) as info:
        load_problems("dapo_math", path)
    err = info.value
    assert isinstance(err, ValueError)
    assert str(path) in str(err) and "line 3" in str(err) and err.location == "line 3"
    assert err.field == field
    if field:
        assert repr(field) in str(err)


def test_gsm8k_missing_marker(tmp_path):
    path = _write(tmp_path, [{"question": "q", "answer": "it is 4"}])
    with pytest.raises(DatasetError, match=r"line 1, field 'answer': expected a solution string ending in"):
        load_problems("gsm8k", path)


def test_parquet_malformed_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"problem": ["a", "b", "c"], "answer": ["1", "", "3"]}), path)
    with pytest.raises(DatasetError, match=r"d\.parquet, row 1, field 'answer'"):
        load_problems("aime24", path)
    good = tmp_path / "g.parquet"
    pq.write_table(pa.table({"problem": ["a"], "answer": [5]}), good)
    assert load_problems("math500", good)[0].answer == "5"  # integer answers become strings


def test_other_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_problems("aime24", tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match="unsupported file type"):
        load_problems("aime24", _write(tmp_path, [], name="d.csv"))
    with pytest.raises(DatasetError, match="no rows"):
        load_problems("aime24", _write(tmp_path, []))
    with pytest.raises(ValueError, match="unknown data set 'mmlu'"):
        load_problems("mmlu", tmp_path / "x.jsonl")


def test_generic_loader_and_problem_source(tmp_path):
    path = _write(tmp_path, [{"q": {"text": "2+2="}, "a": 4}])
    problems = load_file_problems(path, prompt_key="q.text", answer_key="a", id_prefix="x-")
    assert problems[0].prompt == "2+2=" and problems[0].answer == "4" and problems[0].id == "x-0"
    custom = problem_source(DataConfig(name="custom", path=str(path), prompt_key="q.text", answer_key="a"))
    assert custom == [Problem("2+2=", "4", "custom-0")]
    assert isinstance(problem_source(DataConfig()), ArithProblems)
    with pytest.raises(ValueError, match="data.path is required"):
        problem_source(DataConfig(name="dapo_math"))


def test_every_other_column_reaches_the_problem(tmp_path):
    """Columns besides the prompt and the answer are kept, nested ones whole (reward functions read them)."""
    rows = tmp_path / "code.jsonl"
    row = {"prompt": "add", "reward_model": {"ground_truth": "3", "style": "rule"}, "tests": ["assert f(1)"],
           "entry_point": "f", "extra": {"a": [1, {"b": 2}]}}  # fmt: skip
    rows.write_text(json.dumps(row) + "\n")
    (problem,) = load_file_problems(rows, prompt_key="prompt", answer_key="reward_model.ground_truth")
    expected = {"reward_model": {"style": "rule"}, "tests": ["assert f(1)"], "entry_point": "f",
                "extra": {"a": [1, {"b": 2}]}}  # fmt: skip
    assert problem.metadata == expected
    assert problem == load_file_problems(rows, prompt_key="prompt", answer_key="reward_model.ground_truth")[0]
    arith = ArithProblems(ArithDataConfig(max_operand=1), 0)
    assert arith[1].metadata == {"a": 0, "op": "+", "b": 1}
