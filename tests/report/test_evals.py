"""`dsv4rl report`'s eval table: periodic evals and `dsv4rl eval` reports of a run, by step, with the
weights each scored (older reports without `weights` named by their file)."""

from __future__ import annotations

import json
from pathlib import Path

from dsv4rl.report.evals import collect_evals, evals_section


def write(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))


def scores(p: float) -> dict:
    return {"pass@1": p, "pass@8": 1.0, "avg@8": p, "maj@8": 1.0, "eval": "tiny_arith"}


def test_rows_by_step_with_the_weights_each_scored(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write(run / "eval" / "step_00000020.json", {**scores(0.4), "weights": {"kind": "training", "step": 20}})
    write(run / "eval" / "step_00000040.json", scores(0.8))  # written before reports named their weights
    write(run / "eval" / "tiny_arith" / "eval.json", {**scores(0.05), "weights": {"kind": "tiny_model"}})
    checkpoint = {"kind": "checkpoint", "step": 40, "checkpoint": "c", "run": str(run)}
    write(run / "eval" / "tiny_arith" / "step_00000040" / "eval.json", {**scores(0.9), "weights": checkpoint})
    write(run / "eval" / "tiny_arith" / "logs" / "x.json", {"not": "a report"})
    (run / "eval" / "step_00000060.json").write_text("{cut sh")  # a report being written: skipped
    rows = collect_evals(run)
    assert [(r.step, r.source, r.scores["pass@1"]) for r in rows] == [
        (None, "dsv4rl eval", 0.05),
        (20, "training", 0.4),
        (40, "training", 0.8),
        (40, "dsv4rl eval", 0.9),
    ]
    assert rows[2].weights == "training weights at step 40" and rows[3].weights == "checkpoint step 40"
    table = evals_section(rows, run)
    assert table[0] == "| step | eval set | by | weights | pass@1 | avg@8 | maj@8 | report |"
    assert "| 40 | tiny_arith | dsv4rl eval | checkpoint step 40 | 0.9000 | 0.9000 | 1.0000 |" in table[-1]
    assert table[-1].endswith("`eval/tiny_arith/step_00000040/eval.json` |")
    assert collect_evals(tmp_path / "none") == []
