"""What SGLang supports per GPU family (`dsv4rl.checks.sglang_families`): one table, read by validation."""

from __future__ import annotations

import pytest
from recipe_problems import recipe_problems as problems

from dsv4rl.checks import sglang_families
from dsv4rl.checks.sglang_families import FINDINGS, FamilyFinding, check_families
from dsv4rl.config.choices import DeviceKind
from dsv4rl.config.compose import compose
from dsv4rl.config.sglang_choices import DeviceFamily
from dsv4rl.quant.sglang_moe import DEVICE_FAMILY

REPLAY = ("algo.indexer_replay=true", "parallel.rollout.data_parallel=8")  # attention TP 1
ROCM = [kind for kind, family in DEVICE_FAMILY.items() if family in (DeviceFamily.cdna3, DeviceFamily.cdna4)]


def family_problems(recipe: str, *overrides: str) -> list[str]:
    found: list[str] = []
    check_families(compose(recipe, list(overrides)), found.append)
    return found


def test_indexer_replay_is_refused_on_mi355x_naming_the_reason_and_the_fix() -> None:
    (problem,) = problems("dapo_math", "cluster.device=mi355x", *REPLAY)
    assert problem.startswith("algo.indexer_replay=true asks SGLang for the CSA indexer's top-k")
    assert "runs on h100, h200 only: on mi355x (cdna4)" in problem
    assert "sglang/srt/state_capturer/indexer_topk.py" in problem
    assert "set algo.indexer_replay=false" in problem


def test_indexer_replay_plans_on_h200() -> None:
    assert problems("dapo_math", "cluster.device=h200", "run.force_memory_plan=true", *REPLAY) == []


@pytest.mark.parametrize("kind", ROCM, ids=str)
def test_indexer_replay_is_refused_on_every_rocm_kind(kind: DeviceKind) -> None:
    found = family_problems("dapo_math", f"cluster.device={kind.value}", *REPLAY)
    (problem,) = [p for p in found if p.startswith("algo.indexer_replay=true")]  # gfx942: FP8 updates too
    assert f"on {kind.value} (" in problem and "algo.indexer_replay=false" in problem


def test_an_unknown_family_is_refused_naming_the_override() -> None:
    found = family_problems("tiny_arith", "parallel.rollout.engine=sglang", "algo.indexer_replay=true")
    (problem,) = found
    assert "cluster.device=cpu does not name the GPU: set cluster.device" in problem
    assert "cluster.device=h100 runs it" in problem


def test_the_reference_engine_replays_on_any_device() -> None:
    assert family_problems("tiny_arith", "algo.indexer_replay=true", "algo.routing_replay=true") == []


def test_deterministic_inference_without_the_custom_all_reduce_is_refused_on_rocm_above_tp2() -> None:
    flag = "engine.extra_args=[--disable-custom-all-reduce]"
    (problem,) = family_problems("dapo_math", "engine.reproducible_sampling=true", flag)
    assert "engine.reproducible_sampling=true asks SGLang for deterministic inference" in problem
    assert "overrides.py" in problem and "remove --disable-custom-all-reduce" in problem
    on = "engine.reproducible_sampling=true"
    assert family_problems("dapo_math", on, flag, "cluster.device=h200") == []
    assert family_problems("dapo_math", "engine.reproducible_sampling=false", flag) == []
    two = ("parallel.rollout.tensor_parallel=2", "parallel.rollout.expert_parallel=2")
    assert family_problems("dapo_math", "engine.reproducible_sampling=true", flag, *two) == []


def test_the_moe_update_row_reads_the_moe_path_table_once() -> None:
    found = problems("dapo_math", "quant=fp8_mxfp4")
    assert len([p for p in found if "weight updates fail or corrupt the engines" in p]) == 1


def test_every_row_names_its_families_source_and_fix() -> None:
    for finding in FINDINGS:
        if isinstance(finding, FamilyFinding):
            assert finding.runs_on and DeviceFamily.unknown not in finding.runs_on, finding
            assert finding.source.startswith("sglang/srt/") and finding.fix and finding.key, finding


def test_the_next_finding_is_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    row = FamilyFinding(
        feature="routing replay", key="algo.routing_replay=true", asks=lambda cfg: cfg.algo.routing_replay,
        runs_on=frozenset({DeviceFamily.cdna4}), elsewhere="(a test row)", source="sglang/srt/x.py:1",
        fix="set algo.routing_replay=false",
    )  # fmt: skip
    monkeypatch.setattr(sglang_families, "FINDINGS", [*FINDINGS, row])
    on = "algo.routing_replay=true"
    assert problems("dapo_math", on) == []
    (problem,) = problems("dapo_math", on, "cluster.device=h200", "run.force_memory_plan=true")
    assert problem.startswith("algo.routing_replay=true asks SGLang for routing replay")
    assert "(a test row)" in problem
