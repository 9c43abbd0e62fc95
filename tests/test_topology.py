"""The recipe's topology, computed once: nodes and roles, engines and URLs, ranks and coordinates."""

from __future__ import annotations

import pytest

from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.topology import topology

ADDRS = "cluster.node_addrs=[n0,n1,n2,n3]"


def test_the_reference_run():
    """dapo_math: 2 trainer nodes (TP1/PP4/EP4 over 16 ranks), 2 rollout nodes with one TP8 engine each."""
    layout = topology(compose("dapo_math", [ADDRS]))
    assert [(n.node, n.roles) for n in layout.nodes] == [
        (0, ["trainer"]),
        (1, ["trainer"]),
        (2, ["rollout"]),
        (3, ["rollout"]),
    ]
    assert [(e.index, e.node, e.local, e.port) for e in layout.engines] == [
        (0, 2, 0, 30000),
        (1, 3, 0, 30000),
    ]
    assert layout.engine_urls() == ["http://n2:30000", "http://n3:30000"]
    assert [e.name for e in layout.remote_engines(0)] == ["engine-0", "engine-1"]
    assert layout.remote_engines(2) == []  # a rollout node waits for no one
    ranks = layout.ranks
    assert len(ranks) == 16 and [r.node for r in ranks] == [0] * 8 + [1] * 8
    assert [r.pipeline for r in ranks] == [s for s in range(4) for _ in range(4)]  # pipeline outermost
    assert [r.expert for r in ranks[:4]] == [0, 1, 2, 3] and [r.data for r in ranks[:4]] == [0, 1, 2, 3]
    assert {r.tensor for r in ranks} == {0}
    assert [(s.stage, s.rank, s.node) for s in layout.sync_sources] == [
        (0, 0, 0),
        (1, 4, 0),
        (2, 8, 1),
        (3, 12, 1),
    ]


def test_engine_urls_need_every_node_address():
    layout = topology(compose("dapo_math"))
    assert layout.engines[0].url is None
    with pytest.raises(ConfigError, match="cluster.node_addrs"):
        layout.engine_urls()


def test_one_cpu_node_does_everything():
    layout = topology(compose("tiny_arith", ["parallel=cpu_fsdp2"]))
    (node,) = layout.nodes
    assert node.roles == ["trainer", "rollout"] and node.ranks == (0, 1)
    assert layout.engine_urls() == ["http://127.0.0.1:30000"]
    assert [(r.data, r.pipeline) for r in layout.ranks] == [(0, 0), (1, 0)]  # FSDP: data-parallel only


def test_tensor_and_pipeline_coordinates_of_megatron():
    cfg = compose(
        "tiny_arith",
        [
            "parallel.train.backend=megatron",
            "parallel.train.nproc_per_node=8",
            "parallel.train.tensor_parallel=2",
            "parallel.train.pipeline_parallel=2",
        ],
    )
    ranks = topology(cfg).ranks
    assert [(r.tensor, r.data, r.pipeline) for r in ranks] == [
        (t, d, p) for p in range(2) for d in range(2) for t in range(2)
    ]
