"""The reference run's table (src/dsv4rl/config/reference_run.yaml, docs/reference_run.md) against the
recipes: every setting marked same holds in dapo_math, the doc prints the table as the YAML holds it, and
`dsv4rl plan` names what a config changes."""

from __future__ import annotations

from pathlib import Path

from dsv4rl.config.compose import compose
from dsv4rl.config.reference_run import GROUP_TITLES, compare, markdown_tables, reference_rows

DOC = Path(__file__).resolve().parents[2] / "docs" / "reference_run.md"


def test_every_row_has_a_source_and_every_group_a_title():
    rows = reference_rows()
    assert len(rows) > 100
    for row in rows:
        assert row.source.strip() and row.group in GROUP_TITLES, row
        assert row.status == "same" or row.why, f"{row.setting}: a row that is not the same says why"


def test_dapo_math_keeps_every_row_marked_same():
    comparison = compare(compose("dapo_math", []))
    assert comparison.changed == (), [(r.key, r.expected, v) for r, v in comparison.changed]
    assert len(comparison.kept) == sum(r.status == "same" for r in reference_rows())
    assert comparison.line().endswith(f"keeps {len(comparison.kept)} of its {len(comparison.kept)} settings")


def test_an_override_of_a_reference_setting_is_named():
    comparison = compare(
        compose("dapo_math", ["algo.sampling.temperature=1.0", "data.reasoning_effort=high"])
    )
    assert [row.key for row, _ in comparison.changed] == [
        "data.reasoning_effort",
        "algo.sampling.temperature",
    ]
    line = comparison.line()
    assert "keeps" in line and "algo.sampling.temperature (0.8 -> 1.0)" in line
    assert "data.reasoning_effort (low -> high)" in line


def test_the_tir_and_h200_recipes_change_only_what_their_purpose_needs():
    tir = compare(compose("dapo_math_tir", []))
    assert tir.changed == (), [(r.key, v) for r, v in tir.changed]
    h200 = compare(compose("dapo_math_h200", []))
    changed = {row.key for row, _ in h200.changed}
    # NVIDIA's NCCL environment, and twice the training nodes for 141 GB GPUs: nothing of the algorithm
    assert changed and all(k.startswith(("comm.env", "parallel.train.", "cluster.")) for k in changed), (
        changed
    )


def test_the_doc_prints_the_table_the_yaml_holds():
    assert markdown_tables() in DOC.read_text(), (
        "regenerate docs/reference_run.md's table (markdown_tables())"
    )
