"""parallel.colocate=true in the plan: the memory saver on every engine (SGLang's flag, with its type), no
weight-sync group port, the plan naming the tensor transport, and validation refusing what cannot work."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4rl.checks.validate import validate
from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.engine.sglang_contract import flag_problems, load_contract
from dsv4rl.launcher.plan import build_local_plan, planned_ports
from dsv4rl.launcher.plan_view import _layout_text, training_layout

RUN = Path("/tmp/dsv4rl-colocate-plan")


def problems(overrides: list[str], recipe: str = "tiny_arith") -> list[str]:
    try:
        validate(compose(recipe, overrides), check_paths=False)
    except ConfigError as error:
        return error.problems
    return []


@pytest.mark.parametrize("colocate", [False, True])
def test_engines_get_the_memory_saver_only_when_colocated(colocate: bool) -> None:
    cfg = compose("tiny_arith", [f"parallel.colocate={str(colocate).lower()}"])
    engine = build_local_plan(cfg, RUN, base_env={})[0]
    assert ("--enable-memory-saver" in engine.argv) == colocate
    what = {p.what for p in planned_ports(cfg)}
    assert ("weight sync" in what) != colocate  # no group to host: the handles go over HTTP
    layout = training_layout(cfg)
    assert layout["weight_sync_transport"] == ("tensor" if colocate else "broadcast")
    assert ("by tensor handles" in _layout_text(layout)) == colocate


def test_sglang_engines_colocated_on_one_gpu_node_take_the_flag_as_sglang_does() -> None:
    overrides = [
        "parallel.colocate=true", "parallel.rollout.engine=sglang", "parallel.rollout.gpus_per_engine=2",
        "parallel.rollout.tensor_parallel=2", "parallel.rollout.num_engines=4", "cluster.gpus_per_node=8",
        "parallel.train.nproc_per_node=8", "comm=nccl_h100",
    ]  # fmt: skip
    cfg = compose("tiny_arith", overrides)
    engines = [s for s in build_local_plan(cfg, RUN, base_env={}) if s.role == "engine"]
    assert len(engines) == 4 and all("--enable-memory-saver" in s.argv for s in engines)
    assert flag_problems(load_contract(), engines[0].argv[3:]) == []


def test_colocate_across_nodes_is_refused() -> None:
    assert problems(["parallel.colocate=true"]) == []
    refused = problems(
        ["parallel.colocate=true", "cluster.nnodes=2", "parallel.train.nnodes=2", "cluster.node_addrs=[a,b]"]
    )
    assert any("colocate on one node" in p for p in refused), refused
    both = problems(["parallel.colocate=true", "parallel.rollout.nnodes=1", "cluster.nnodes=2"])
    assert any("shares the training GPUs" in p for p in both), both
