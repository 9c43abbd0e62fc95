"""The published reference run, setting by setting (reference_run.yaml beside this file; docs/reference_run.md
in prose): which of its settings a composed config keeps.

A row with `status: same` names a dsv4rl key and the value there that is the reference's (its `dsv4rl`:
`reference` says it as the source does, which may be words). For any
composed config, `compare` says which of those rows it still keeps and which it changes, so a user who
overrides a key the published curve depends on (`algo.sampling.temperature=1.0`) is told so by `dsv4rl
plan`, and a test fails when the recipe drifts from a row marked same.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

TABLE = Path(__file__).with_name("reference_run.yaml")
STATUSES = ("same", "different", "missing")
GROUP_TITLES = {
    "data": "Data", "prompt": "Prompt and chat template", "sampling": "Sampling",
    "batch": "Batch and group sizes",
    "oversampling_filters": "Over-sampling and filters", "loss": "Loss, clipping and reward",
    "tis_mis": "TIS / MIS", "kl_entropy": "KL and entropy", "optimizer": "Optimizer and schedule",
    "frozen_parameters": "Frozen parameters", "routing_replay": "Routing replay",
    "precision": "Precision and quantization", "parallel": "Parallel layout",
    "sequence_limits": "Sequence limits", "max_tokens_per_gpu": "Max tokens per GPU",
    "balance_data": "Balance data", "engine": "Engine flags", "environment": "Environment", "eval": "Eval",
    "mode": "Mode: async, staleness, pause", "update_buffer": "Update buffer",
    "fault_tolerance": "Fault tolerance and checkpoints", "deterministic": "Deterministic training",
    "model": "Model",
}  # fmt: skip


@dataclass(frozen=True)
class ReferenceRow:
    setting: str
    group: str
    reference: Any  # as the source states it (a number, a flag, or words)
    source: str
    key: str | None
    status: str
    expected: Any  # the value at `key` that is the reference's (the table's `dsv4rl`)
    why: str = ""


@dataclass(frozen=True)
class ReferenceComparison:
    """Of the rows marked same: those this config keeps, and those it changes (key, reference, value)."""

    kept: tuple[ReferenceRow, ...]
    changed: tuple[tuple[ReferenceRow, Any], ...]

    def line(self) -> str:
        """One line for `dsv4rl plan`."""
        total = len(self.kept) + len(self.changed)
        head = f"reference run (docs/reference_run.md): keeps {len(self.kept)} of its {total} settings"
        if not self.changed:
            return head
        shown = [f"{row.key} ({_text(row.expected)} -> {_text(value)})" for row, value in self.changed[:12]]
        more = f", and {len(self.changed) - 12} more" if len(self.changed) > 12 else ""
        return f"{head}; changes {', '.join(shown)}{more}"


@functools.cache
def reference_rows() -> tuple[ReferenceRow, ...]:
    """Every row of the table, checked: a status it knows, a key for every `same`."""
    rows = []
    for index, entry in enumerate(yaml.safe_load(TABLE.read_text())):
        row = ReferenceRow(
            str(entry["setting"]), str(entry["group"]), entry.get("reference"), str(entry["source"]),
            entry.get("key"), str(entry["status"]), entry.get("dsv4rl"), str(entry.get("why") or ""),
        )  # fmt: skip
        if (
            row.status not in STATUSES
            or (row.status == "same" and not row.key)
            or row.group not in GROUP_TITLES
        ):
            raise ValueError(
                f"{TABLE} entry {index} ({row.setting!r}): status {row.status!r} with key {row.key}"
            )
        rows.append(row)
    return tuple(rows)


def _plain(value: Any) -> Any:
    """A config value as the table writes it: enums by value, containers as plain lists and dicts."""
    if isinstance(value, Enum):
        return value.value
    if OmegaConf.is_config(value):
        return _plain(OmegaConf.to_container(value, resolve=True))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _equal(reference: Any, value: Any) -> bool:
    if isinstance(reference, dict) and isinstance(value, dict):  # a row may pin part of a mapping
        return all(k in value and _equal(v, value[k]) for k, v in reference.items())
    if (
        isinstance(reference, (int, float))
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    ):
        return math.isclose(float(reference), float(value), rel_tol=1e-12, abs_tol=0.0)
    return reference == value


def _text(value: Any) -> str:
    text = _cell(value)
    return text if len(text) <= 40 else text[:37] + "..."


def compare(cfg: Any) -> ReferenceComparison:
    """Which rows marked same `cfg` (a composed Config) keeps."""
    structured = OmegaConf.structured(cfg)
    kept, changed = [], []
    for row in reference_rows():
        if row.status != "same":
            continue
        value = _plain(OmegaConf.select(structured, row.key, throw_on_missing=False))
        if _equal(row.expected, value):
            kept.append(row)
        else:
            changed.append((row, value))
    return ReferenceComparison(tuple(kept), tuple(changed))


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_tables(rows: tuple[ReferenceRow, ...] | None = None) -> str:
    """The table as docs/reference_run.md prints it, a section per group (the doc is checked against this)."""
    rows = reference_rows() if rows is None else rows
    out = []
    for group, title in GROUP_TITLES.items():
        mine = [r for r in rows if r.group == group]
        if not mine:
            continue
        out += [f"### {title}", "", "| setting | reference | source | dsv4rl key = value | same / why not |",
                "|---|---|---|---|---|"]  # fmt: skip
        for r in mine:
            key = f"`{r.key}` = {_cell(r.expected)}" if r.key else "(no key)"
            verdict = "same" if r.status == "same" else f"**{r.status}**"
            verdict += f": {_cell(r.why)}" if r.why else ""
            out.append(
                f"| {_cell(r.setting)} | {_cell(r.reference)} | {_cell(r.source)} | {key} | {verdict} |"
            )
        out.append("")
    return "\n".join(out)
