"""Which weight version sampled each response token, from the engine's answer.

SGLang (0.5.23) and the reference engine both return `meta_info.weight_versions`: spans
`[{"version", "start", "end"}, ...]` over the output tokens, several when a response was continued across
a weight update (an in-place pause), besides `weight_version` (the last). An engine without the spans
answers for the whole response with its one `weight_version`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def token_versions(meta: Mapping[str, Any], tokens: int) -> list[str]:
    """One version per output token; the spans must cover the `tokens` tokens in order."""
    spans = meta.get("weight_versions")
    if not spans:
        return [str(meta.get("weight_version", ""))] * tokens
    versions: list[str] = []
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        if start != len(versions) or end < start:
            break
        versions += [str(span["version"])] * (end - start)
    if len(versions) != tokens:
        raise ValueError(
            f"the engine's weight-version spans {list(spans)} do not cover its {tokens} output tokens in "
            "order: every token's version is needed to bound and correct staleness"
        )
    return versions


def version_spans(versions: Sequence[str]) -> list[list]:
    """`[[version, start, end], ...]`: the per-token versions as the engines' spans, for the records."""
    spans: list[list] = []
    for index, version in enumerate(versions):
        if spans and spans[-1][0] == version:
            spans[-1][2] = index + 1
        else:
            spans.append([version, index, index + 1])
    return spans
