"""Procedural arithmetic problems for the tiny model: "3+4=" -> "7".

Every prompt uses only characters of the tiny character tokenizer's alphabet (digits, "+-*", "=").
The problem set is the full enumeration of (a, op, b) with 0 <= a, b <= max_operand whose answer lies
in [0, max_answer]; iterating gives an endless sequence of shuffled epochs, fixed by the seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from dsv4rl.config.schema import ArithDataConfig
from dsv4rl.data.problems import Problem

SUPPORTED_OPS = "+-*"
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _validate(cfg: ArithDataConfig) -> list[str]:
    if not isinstance(cfg.max_operand, int) or cfg.max_operand < 0:
        raise ValueError(f"data.arith.max_operand must be an integer >= 0, got {cfg.max_operand!r}")
    if not isinstance(cfg.max_answer, int):
        raise ValueError(f"data.arith.max_answer must be an integer, got {cfg.max_answer!r}")
    ops = list(cfg.ops)
    if not ops:
        raise ValueError(f"data.arith.ops is empty; choose one or more of {list(SUPPORTED_OPS)}")
    bad = [op for op in ops if op not in _APPLY]
    if bad:
        raise ValueError(f"data.arith.ops has unsupported operators {bad}; supported: {list(SUPPORTED_OPS)}")
    if len(set(ops)) != len(ops):
        raise ValueError(f"data.arith.ops repeats an operator: {ops}")
    return ops


def enumerate_arith(cfg: ArithDataConfig) -> list[Problem]:
    """All problems allowed by `cfg`, in a fixed order (op, a, b). Raises ValueError if there are none."""
    ops = _validate(cfg)
    problems = []
    for op in ops:
        for a in range(cfg.max_operand + 1):
            for b in range(cfg.max_operand + 1):
                value = _APPLY[op](a, b)
                if 0 <= value <= cfg.max_answer:
                    expr = f"{a}{op}{b}"
                    columns = {"a": a, "op": op, "b": b}
                    problems.append(Problem(prompt=f"{expr}=", answer=str(value), id=expr, metadata=columns))
    if not problems:
        raise ValueError(
            f"no arithmetic problem fits data.arith (max_operand={cfg.max_operand}, ops={ops}, "
            f"max_answer={cfg.max_answer}): answers must lie in [0, max_answer]; "
            "set data.arith.max_answer >= 0 (and raise it or data.arith.max_operand for more problems)"
        )
    return problems


class ArithProblems(Sequence[Problem]):
    """The enumerated problem set (a finite sequence, fixed order) plus seeded shuffled epochs.

    `PromptStream` takes an `ArithProblems` like any other sequence of problems (and shuffles it
    itself, resumably); `epoch(k)` and `iter_epochs()` give this class's own shuffled order.
    Plain iteration (`for p in arith`, `list(arith)`) is finite: one pass in fixed order.
    """

    def __init__(self, cfg: ArithDataConfig, seed: int = 0):
        self.cfg = cfg
        self.seed = seed
        self.problems: list[Problem] = enumerate_arith(cfg)

    def __len__(self) -> int:
        return len(self.problems)

    def __getitem__(self, index):  # type: ignore[override]
        return self.problems[index]

    def epoch(self, k: int) -> list[Problem]:
        """Epoch `k` (0-based): a permutation of the problem set depending only on (seed, k)."""
        order = list(self.problems)
        random.Random(f"arith:{self.seed}:{k}").shuffle(order)
        return order

    def iter_epochs(self) -> Iterator[Problem]:
        """Endless: epoch 0, then epoch 1, ..., each a fresh seeded shuffle."""
        k = 0
        while True:
            yield from self.epoch(k)
            k += 1


TINY_TOOL_PROMPT = "Q:"
TINY_TOOL_ROWS = 4096


def tiny_tool_problems(max_answer: int, seed: int = 0, rows: int = TINY_TOOL_ROWS) -> list[Problem]:
    """The `tiny_tool` task: every prompt is the same "Q:", each row hides a digit in 0..max_answer (its
    `secret` column and its answer). No policy can beat a guess without reading the row, and the only
    way to read it is the `lookup` tool (`builtin:lookup`), so the reward measures tool use."""
    if not 0 <= max_answer <= 9:
        raise ValueError(f"data.arith.max_answer={max_answer}: tiny_tool hides one digit, 0..9")
    rng = random.Random(f"tiny_tool:{seed}")
    out = []
    for index in range(rows):
        secret = rng.randint(0, max_answer)
        out.append(Problem(TINY_TOOL_PROMPT, str(secret), f"tool-{index}", metadata={"secret": secret}))
    return out
