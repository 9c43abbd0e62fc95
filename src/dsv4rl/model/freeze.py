"""Which tensors `train.freeze` keeps fixed: its entries as rules on transformers' DeepSeek-V4 names.

An entry is a group (`FreezeGroup`) or a pattern:
- `router_gate`: every MoE router's gate weight, `model.layers.N.mlp.gate.weight` (the hash-routed layers'
  too: their gate still weights the experts the table picks);
- `router_bias`: the score routers' expert score-correction bias,
  `model.layers.N.mlp.gate.e_score_correction_bias`;
- `glob:PATTERN`: shell-style on the whole name (`*` spans dots too), e.g. `glob:model.layers.*.mlp.gate.*`;
- `re:PATTERN`: a Python regular expression matched against the whole name (`re.fullmatch`).

The names are transformers' (`model.layers.3.self_attn.q_a_proj.weight`, the routed experts stacked as
`mlp.experts.gate_up_proj` / `down_proj`): what the `fsdp` backend holds, what both backends sync and
export under, and what the `megatron` backend maps each of its tensors to (`train/megatron/convert.py`). So
an entry names the same tensors in both backends. An entry covers parameters and persistent buffers alike
(the correction bias is a buffer in both). Nothing here imports torch: recipe validation checks the entries.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dsv4rl.config.choices import FreezeGroup

GLOB, REGEX = "glob:", "re:"
GROUP_PATTERNS: dict[FreezeGroup, str] = {
    FreezeGroup.router_gate: r"model\.layers\.\d+\.mlp\.gate\.weight",
    FreezeGroup.router_bias: r"model\.layers\.\d+\.mlp\.gate\.e_score_correction_bias",
}
KEY = "train.freeze"


class FreezeError(ValueError):
    """A `train.freeze` entry that cannot be used; the message names it and the fix."""


@dataclass(frozen=True)
class FreezeEntry:
    text: str  # as the recipe spells it
    pattern: re.Pattern[str]

    def matches(self, name: str) -> bool:
        return self.pattern.fullmatch(name) is not None


def _entry(text: str) -> FreezeEntry | str:
    """The entry, or why it is refused."""
    if text in {group.value for group in FreezeGroup}:
        return FreezeEntry(text, re.compile(GROUP_PATTERNS[FreezeGroup(text)]))
    if text.startswith(GLOB):
        body = text.removeprefix(GLOB)
        if not body:
            return f"{KEY} entry {text!r} has an empty pattern"
        return FreezeEntry(text, re.compile(fnmatch.translate(body)))
    if text.startswith(REGEX):
        body = text.removeprefix(REGEX)
        if not body:
            return f"{KEY} entry {text!r} has an empty pattern"
        try:
            return FreezeEntry(text, re.compile(body))
        except re.error as error:
            return f"{KEY} entry {text!r} is not a regular expression ({error})"
    return (
        f"{KEY} entry {text!r} is neither a group ({', '.join(FreezeGroup)}) nor a pattern on "
        "transformers' tensor names (`glob:model.layers.*.mlp.gate.weight`, `re:model\\.layers\\.\\d+\\..*`)"
    )


def entry_problems(entries: Iterable[str]) -> list[str]:
    """Why each refused entry of `train.freeze` is refused (empty: all usable)."""
    problems = [found for text in entries if isinstance(found := _entry(text), str)]
    seen: set[str] = set()
    for text in entries:
        if text in seen:
            problems.append(f"{KEY} lists {text!r} twice")
        seen.add(text)
    return problems


def parse_entries(entries: Sequence[str]) -> list[FreezeEntry]:
    """The rules of `train.freeze`; FreezeError listing every refused entry."""
    problems = entry_problems(entries)
    if problems:
        raise FreezeError("; ".join(problems))
    return [entry for entry in map(_entry, entries) if isinstance(entry, FreezeEntry)]


def matching_entries(entries: Sequence[FreezeEntry], names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(entries that freeze a tensor stored under transformers' `names`, entries that match only some of
    them). One backend tensor can hold several transformers tensors (megatron's fused shared-expert
    gate/up rows): it is frozen only when an entry matches all of them, and a partial match is an error,
    since the other backend would freeze a part of it."""
    whole, partial = [], []
    for entry in entries:
        hits = sum(entry.matches(name) for name in names)
        if hits == len(names):
            whole.append(entry.text)
        elif hits:
            partial.append(entry.text)
    return whole, partial


def unmatched_message(unmatched: Sequence[str]) -> str:
    """The refusal of entries that match no tensor of the model."""
    which = "entry" if len(unmatched) == 1 else "entries"
    verb = "matches" if len(unmatched) == 1 else "match"
    return (
        f"{KEY} {which} {', '.join(map(repr, unmatched))} {verb} no tensor of the model; patterns match "
        "transformers' DeepSeek-V4 names as a whole (e.g. `glob:model.layers.*.mlp.gate.weight`): "
        "fix or remove them"
    )
