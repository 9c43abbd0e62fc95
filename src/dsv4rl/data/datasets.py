"""Loaders for the math data sets (DAPO-Math-17k, AIME-2024, MATH-500, GSM8K) and generic jsonl/parquet.

Every loader returns `list[Problem]`. A malformed row stops the load with a `DatasetError` that names
the file, where in it (jsonl: "line N", 1-based; parquet: "row N", 0-based), the field and what was
expected: a silently skipped row would change the training distribution unnoticed.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4rl.config.schema import DataConfig
from dsv4rl.data.arith import ArithProblems, tiny_tool_problems
from dsv4rl.data.problems import Problem

# DAPO-Math-17k's prompt template (its prompts already contain it); use it to ask AIME/MATH problems
# in the format the "dapo" grader reads ("Answer: ..." on the last line).
DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)

_CHAT_EXPECTED = 'a non-empty string or a chat list [{"role": "user", "content": "..."}]'


class DatasetError(ValueError):
    """A data file that cannot be read as problems; the message says where and what was expected."""

    def __init__(self, path: str | Path, location: str | None, field: str | None, message: str):
        self.path, self.location, self.field = str(path), location, field
        where = f"{path}" + (f", {location}" if location else "") + (f", field {field!r}" if field else "")
        super().__init__(f"{where}: {message}")


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                message = f"invalid JSON ({e.msg} at column {e.colno})"
                raise DatasetError(path, f"line {lineno}", None, message) from None
            yield f"line {lineno}", record


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            f"reading {path} needs pyarrow: `pip install pyarrow` (or `pip install dsv4rl[dev]`), "
            "or give the data as .jsonl instead"
        ) from e
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid etc.
        raise DatasetError(path, None, None, f"not a readable parquet file ({e})") from e
    row = 0
    for batch in parquet.iter_batches(batch_size=4096):
        for record in batch.to_pylist():
            yield f"row {row}", record
            row += 1


def iter_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(location, record) for each row of a .jsonl or .parquet file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _iter_jsonl(path)
    if suffix in (".parquet", ".pq"):
        return _iter_parquet(path)
    raise DatasetError(path, None, None, f"unsupported file type {suffix!r}; expected .jsonl or .parquet")


def _get(record: Any, dotted: str) -> Any:
    """record["a"]["b"] for "a.b"; KeyError when any level is missing."""
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _other_columns(record: dict, prompt_key: str, answer_key: str) -> dict[str, Any]:
    """The row's columns but the prompt and the answer (a dotted key's nested value left out, its
    siblings kept), for reward functions (`RewardInput.metadata`)."""
    out = dict(record)
    for dotted in (prompt_key, answer_key):
        parent, *rest = dotted.split(".")
        if not rest:
            out.pop(parent, None)
        elif isinstance(out.get(parent), dict):
            out[parent] = _other_columns(out[parent], ".".join(rest), "\0")
    return out


def _prompt_text(value: Any) -> str | None:
    """The prompt as text: a string, or the content of a one-message user chat list; None if neither."""
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        message = value[0]
        content = message.get("content")
        if message.get("role") == "user" and isinstance(content, str) and content.strip():
            return content
    return None


def _answer_text(value: Any) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None


def gsm8k_final_answer(solution: str) -> str | None:
    """GSM8K's final answer: the text after the last "####", commas removed ("1,000" -> "1000")."""
    if "####" not in solution:
        return None
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return final or None


def load_file_problems(
    path: str | Path,
    *,
    prompt_key: str,
    answer_key: str,
    id_key: str | None = None,
    id_prefix: str = "",
    answer_extract: Callable[[str], str | None] | None = None,
    answer_expected: str = "a non-empty string or an integer",
    template: str | None = None,
    limit: int | None = None,
) -> list[Problem]:
    """Problems from any .jsonl/.parquet file; keys may be dotted ("reward_model.ground_truth").

    `template` (with a "{problem}" placeholder) wraps each prompt; `limit` keeps the first rows.
    Rows without `id_key` get "<id_prefix><index>".
    """
    if template is not None and "{problem}" not in template:
        raise ValueError(f"template must contain the placeholder '{{problem}}': {template!r}")
    problems: list[Problem] = []
    for index, (where, record) in enumerate(iter_records(path)):
        if limit is not None and index >= limit:
            break
        if not isinstance(record, dict):
            raise DatasetError(path, where, None, f"expected a JSON object, got {type(record).__name__}")
        try:
            raw_prompt = _get(record, prompt_key)
        except KeyError:
            raise DatasetError(path, where, prompt_key, f"missing; expected {_CHAT_EXPECTED}") from None
        prompt = _prompt_text(raw_prompt)
        if prompt is None:
            raise DatasetError(path, where, prompt_key, f"expected {_CHAT_EXPECTED}, got {raw_prompt!r:.80}")
        try:
            raw_answer = _get(record, answer_key)
        except KeyError:
            raise DatasetError(path, where, answer_key, f"missing; expected {answer_expected}") from None
        answer = _answer_text(raw_answer)
        if answer is not None and answer_extract is not None:
            answer = answer_extract(answer)
        if answer is None:
            raise DatasetError(path, where, answer_key, f"expected {answer_expected}, got {raw_answer!r:.80}")
        pid = f"{id_prefix}{index}"
        if id_key is not None:
            with contextlib.suppress(KeyError):
                pid = str(_get(record, id_key))
        if template is not None:
            prompt = template.replace("{problem}", prompt)
        problems.append(
            Problem(
                prompt=prompt, answer=answer, id=pid, metadata=_other_columns(record, prompt_key, answer_key)
            )
        )
    if not problems:
        raise DatasetError(path, None, None, "contains no rows")
    return problems


@dataclass(frozen=True)
class DatasetSpec:
    prompt_key: str
    answer_key: str
    id_key: str | None
    answer_extract: Callable[[str], str | None] | None = None
    answer_expected: str = "a non-empty string or an integer"


DATASETS: dict[str, DatasetSpec] = {
    # prompt: chat list with the DAPO template already applied; answers are integers as strings.
    "dapo_math": DatasetSpec("prompt", "reward_model.ground_truth", "extra_info.index"),
    "aime24": DatasetSpec("problem", "answer", "id"),
    "math500": DatasetSpec("problem", "answer", "unique_id"),
    "gsm8k": DatasetSpec(
        "question", "answer", None, gsm8k_final_answer, 'a solution string ending in "#### <answer>"'
    ),
}
_ALIASES = {"dapo_math_17k": "dapo_math", "aime_2024": "aime24", "math_500": "math500"}


def load_problems(
    name: str, path: str | Path, *, template: str | None = None, limit: int | None = None
) -> list[Problem]:
    """Load a known data set by name ("dapo_math", "aime24", "math500", "gsm8k") from a local file."""
    key = _ALIASES.get(name, name)
    if key not in DATASETS:
        raise ValueError(
            f"unknown data set {name!r}; choose one of {sorted(DATASETS)} or use load_file_problems"
        )
    spec = DATASETS[key]
    return load_file_problems(
        path,
        prompt_key=spec.prompt_key,
        answer_key=spec.answer_key,
        id_key=spec.id_key,
        id_prefix=f"{key}-",
        answer_extract=spec.answer_extract,
        answer_expected=spec.answer_expected,
        template=template,
        limit=limit,
    )


def problem_source(cfg: DataConfig, seed: int = 0) -> Sequence[Problem]:
    """The problems a recipe's `data` section names: procedural arithmetic, a known data set, or a file.

    For names outside `DATASETS` (e.g. "custom"), `cfg.path` is read with `cfg.prompt_key` and
    `cfg.answer_key`; known data sets use their own schema and ignore those keys. The file's last
    `cfg.holdout` rows are left out (an eval set may score them).
    """
    if cfg.name == "tiny_arith":
        return ArithProblems(cfg.arith, seed)
    if cfg.name == "tiny_tool":
        return tiny_tool_problems(cfg.arith.max_answer, seed)
    if not cfg.path:
        raise ValueError(f"data.path is required for data.name={cfg.name!r} (a .jsonl or .parquet file)")
    if _ALIASES.get(cfg.name, cfg.name) in DATASETS:
        problems = load_problems(cfg.name, cfg.path)
    else:
        problems = load_file_problems(
            cfg.path, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key, id_prefix=f"{cfg.name}-"
        )
    return split_holdout(problems, cfg.holdout, f"data.holdout={cfg.holdout}", cfg.path)[0]


def split_holdout(
    problems: list[Problem], holdout: int, what: str, path: str
) -> tuple[list[Problem], list[Problem]]:
    """(all but the last `holdout` problems, those last ones); refuses a hold-out that leaves nothing."""
    if holdout and holdout >= len(problems):
        raise DatasetError(path, None, None, f"has {len(problems)} rows, all of them held out by {what}")
    cut = len(problems) - holdout
    return problems[:cut], problems[cut:]
