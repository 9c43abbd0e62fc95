"""Each response token's weight version, from the spans SGLang and the reference engine return."""

from __future__ import annotations

import pytest

from dsv4rl.rollout.versions import token_versions, version_spans
from dsv4rl.samples import head_version


def test_spans_give_each_token_its_version() -> None:
    meta = {
        "weight_version": "4",
        "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}],
    }
    versions = token_versions(meta, 5)
    assert versions == ["3", "3", "4", "4", "4"]
    assert head_version(versions) == "3"  # the oldest policy the response came from
    assert version_spans(versions) == [["3", 0, 2], ["4", 2, 5]]


def test_without_spans_the_whole_response_has_the_one_version() -> None:
    assert token_versions({"weight_version": 7}, 3) == ["7", "7", "7"]
    assert (
        token_versions(
            {"weight_version": "7", "weight_versions": [{"version": "7", "start": 0, "end": 0}]}, 0
        )
        == []
    )
    assert head_version(["", "", "2"]) == "2"  # inserted tokens carry no version
    assert version_spans(["1", "", "1"]) == [["1", 0, 1], ["", 1, 2], ["1", 2, 3]]


@pytest.mark.parametrize(
    "spans",
    [
        [{"version": "3", "start": 0, "end": 2}],  # short of the 3 tokens
        [{"version": "3", "start": 1, "end": 3}],  # not from the first token
        [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 1, "end": 3}],  # overlapping
    ],
)
def test_spans_that_do_not_cover_the_response_are_refused(spans) -> None:
    with pytest.raises(ValueError, match="do not cover its 3 output tokens"):
        token_versions({"weight_version": "4", "weight_versions": spans}, 3)
