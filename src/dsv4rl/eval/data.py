"""The problems of an eval set: a local file in a known schema, a Hugging Face hub data set, or the
tiny model's arithmetic.

A hub name is written `hf:<owner>/<name>` (so it is never mistaken for a missing local path); reading it
needs the `datasets` package and a network, and an offline machine gets an error saying how to pass a
file instead.
"""

from __future__ import annotations

from pathlib import Path

from dsv4rl.config.choices import EvalSet
from dsv4rl.config.schema import Config
from dsv4rl.data.arith import ArithProblems
from dsv4rl.data.datasets import DAPO_TEMPLATE, DatasetError, load_problems, split_holdout
from dsv4rl.data.problems import Problem

__all__ = ["EVAL_SETS", "HUB_PREFIX", "EvalDataError", "eval_problems"]

# eval set -> the schema of its rows (DATASETS); tiny_arith is procedural
EVAL_SETS: dict[EvalSet, str | None] = {
    EvalSet.tiny_arith: None,
    EvalSet.aime24: "aime24",
    EvalSet.math500: "math500",
    EvalSet.gsm8k: "gsm8k",
    EvalSet.dapo_math_holdout: "dapo_math",
}
HUB_PREFIX = "hf:"
TEMPLATES = {"dapo": DAPO_TEMPLATE}  # eval.prompt_template by name


class EvalDataError(ValueError):
    """The eval set cannot be read; the message names the fix."""


def eval_problems(cfg: Config) -> list[Problem]:
    """The problems `cfg.eval` names, after `holdout`, `max_problems` and the prompt template."""
    e = cfg.eval
    if e is None:
        raise EvalDataError(f"the recipe has no eval set: choose one, e.g. eval={EvalSet.aime24.value}")
    if e.name not in EVAL_SETS:
        raise EvalDataError(f"eval.name={e.name!r} is not an eval set; choose one of {', '.join(EvalSet)}")
    if e.name == EvalSet.tiny_arith:
        problems = list(ArithProblems(cfg.data.arith, cfg.seed))
    elif e.dataset is None:
        raise EvalDataError(f"eval {e.name!r} needs its data: pass data.path=<file> or set DSV4RL_DATA_DIR")
    elif e.dataset.startswith(HUB_PREFIX):
        problems = _hub_problems(e.dataset.removeprefix(HUB_PREFIX), EVAL_SETS[e.name])
    else:
        problems = load_problems(EVAL_SETS[e.name], e.dataset)
    if e.holdout:
        problems = split_holdout(problems, e.holdout, f"eval.holdout={e.holdout}", str(e.dataset))[1]
    if e.max_problems is not None:
        problems = problems[: e.max_problems]
    template = TEMPLATES.get(e.prompt_template, e.prompt_template) if e.prompt_template else None
    if template is not None:
        problems = [Problem(template.replace("{problem}", p.prompt), p.answer, p.id) for p in problems]
    return problems


def _hub_problems(name: str, schema: str) -> list[Problem]:
    fix = (
        f"download the set and pass data.path=<file> (a .jsonl or .parquet in the {schema} schema), "
        "or set DSV4RL_DATA_DIR to the directory holding it"
    )
    try:
        import datasets
    except ImportError:
        raise EvalDataError(
            f"eval data hf:{name} needs the `datasets` package (pip install datasets); or {fix}"
        ) from None
    try:
        rows = datasets.load_dataset(name, split="test")
    except Exception as exc:  # offline, unknown name, no test split
        raise EvalDataError(f"could not load hf:{name} from the Hugging Face hub ({exc}); {fix}") from None
    cache = Path(rows.cache_files[0]["filename"]).with_suffix(".jsonl") if rows.cache_files else None
    if cache is None:
        raise EvalDataError(f"hf:{name} has no local cache file to read; {fix}")
    rows.to_json(str(cache))
    try:
        return load_problems(schema, cache)
    except DatasetError as exc:
        raise EvalDataError(f"hf:{name} does not have the {schema} schema: {exc}") from None
