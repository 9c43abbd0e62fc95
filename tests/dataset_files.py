"""Where the tests find the real data sets (AIME-2024, DAPO-Math-17K, MATH-500, GSM8K): `$DSV4RL_DATA_DIR`, as
the recipes do. Without it the tests that read them skip, naming the variable; with `DSV4RL_REQUIRE_DATA=1`
(CI sets both) a missing directory stops the run instead, so CI never passes by skipping them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DATA_ENV = "DSV4RL_DATA_DIR"
REQUIRE_ENV = "DSV4RL_REQUIRE_DATA"
FILES = ("aime24.jsonl", "math500.jsonl", "gsm8k_test.jsonl", "dapo_math_17k.parquet",
         "dapo_math_17k_sample300.jsonl")  # fmt: skip

DATA = Path(os.environ.get(DATA_ENV) or "data")
_missing = [name for name in FILES if not (DATA / name).is_file()]
_why = (
    f"${DATA_ENV} ({DATA}) lacks {', '.join(_missing)}: set {DATA_ENV} to the directory holding the data sets"
)
if _missing and os.environ.get(REQUIRE_ENV) == "1":
    raise RuntimeError(f"{REQUIRE_ENV}=1 but {_why}")

needs_data = pytest.mark.skipif(bool(_missing), reason=_why)
