"""The node plan: exact commands, environment and port checks for reference and SGLang engines."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from dsv4rl.config.choices import Dtype, RolloutEngineKind
from dsv4rl.config.compose import ConfigError
from dsv4rl.config.schema import Config
from dsv4rl.launcher.plan import (
    SGLANG_SITE,
    WEIGHT_SYNC_TIMEOUT_ENV,
    PortInUse,
    build_local_plan,
    check_ports,
    engine_placement,
    engine_urls,
    planned_ports,
    port_is_free,
    remote_engine_health,
)
from free_ports import free_port, free_ports

RUN = Path("/runs/r1")


def by_name(specs):
    return {s.name: s for s in specs}


@pytest.mark.parametrize("nproc", [1, 2])
def test_reference_engines_and_fsdp_trainer(nproc):
    cfg = Config(seed=7)
    cfg.parallel.rollout.num_engines = 2
    cfg.parallel.train.nproc_per_node = nproc
    cfg.engine.max_batch_size = 32
    cfg.engine.extra_args = ["--log-level", "debug"]
    specs = build_local_plan(cfg, RUN, base_env={"PATH": "/bin"})
    assert [s.name for s in specs] == ["engine-0", "engine-1", "trainer"]
    assert [s.role for s in specs] == ["engine", "engine", "trainer"]
    e1 = by_name(specs)["engine-1"]
    assert e1.argv == [
        sys.executable, "-m", "dsv4rl.engine",
        "--model-path", "/runs/r1/model",
        "--host", "127.0.0.1",
        "--port", "30001",
        "--random-seed", "8",
        "--max-batch-size", "32",
        "--log-level", "debug",
    ]  # fmt: skip
    assert e1.health_url == "http://127.0.0.1:30001/health_generate"
    assert e1.log_path == RUN / "logs" / "engine-1.log"
    trainer = by_name(specs)["trainer"]
    assert trainer.argv == [
        sys.executable, "-m", "dsv4rl.train.torchrun",
        "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", "29500",
        "-m", "dsv4rl.train.worker", "--config", "/runs/r1/config.yaml",
    ]  # fmt: skip
    assert trainer.health_url is None
    assert engine_urls(cfg) == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    assert not [key for key in trainer.env if key.startswith("DSV4RL_ENGINE")]  # read from the config


def test_env_merges_comm_preset_and_splits_cpu_threads(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    cfg = Config()
    cfg.parallel.train.nproc_per_node = 2
    cfg.comm.env = {"NCCL_DEBUG": "WARN", "PATH": "/override"}
    specs = build_local_plan(cfg, RUN, base_env={"PATH": "/bin", "HOME": "/h"})
    for spec in specs:
        assert spec.env["NCCL_DEBUG"] == "WARN" and spec.env["PATH"] == "/override"
        assert spec.env["HOME"] == "/h" and spec.env["PYTHONUNBUFFERED"] == "1"
    # the synchronous loop takes turns: each side splits every core (8 / 1 engine, 8 / 2 ranks)
    assert {s.name: s.env["OMP_NUM_THREADS"] for s in specs} == {"engine-0": "8", "trainer": "4"}
    cfg.algo.async_rollout = True  # engines and trainer work at once: 8 cores / (1 engine + 2 ranks)
    assert {s.env["OMP_NUM_THREADS"] for s in build_local_plan(cfg, RUN, base_env={})} == {"2"}
    cfg.algo.async_rollout, cfg.algo.max_staleness = False, 1  # the same loop by its bound
    assert {s.env["OMP_NUM_THREADS"] for s in build_local_plan(cfg, RUN, base_env={})} == {"2"}
    cfg.algo.max_staleness = None
    cfg.comm.env = {"OMP_NUM_THREADS": "3"}
    assert {s.env["OMP_NUM_THREADS"] for s in build_local_plan(cfg, RUN, base_env={})} == {"3"}
    cfg.comm.env = {}
    cfg.cluster.gpus_per_node = 8
    assert all("OMP_NUM_THREADS" not in s.env for s in build_local_plan(cfg, RUN, base_env={}))


def test_model_path_is_used_when_set():
    cfg = Config()
    cfg.model.path = "/models/dsv4-flash"
    engine = build_local_plan(cfg, RUN, base_env={})[0]
    assert engine.argv[engine.argv.index("--model-path") + 1] == "/models/dsv4-flash"


def test_sglang_engines_on_gpus():
    cfg = Config(seed=1)
    ro = cfg.parallel.rollout
    ro.engine = RolloutEngineKind.sglang
    ro.num_engines, ro.gpus_per_engine, ro.tensor_parallel, ro.expert_parallel = 2, 2, 2, 2
    ro.mem_fraction_static, ro.max_running_requests, ro.watchdog_timeout_s = 0.5, 48, 1800.0
    cfg.cluster.gpus_per_node = 8
    cfg.parallel.train.nproc_per_node = 4
    specs = by_name(build_local_plan(cfg, RUN, base_env={}))
    assert specs["engine-1"].argv == [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", "/runs/r1/model",
        "--host", "127.0.0.1", "--port", "30001",
        "--tp-size", "2", "--ep-size", "2",
        "--base-gpu-id", "2",
        "--random-seed", "2",
        "--watchdog-timeout", "1800",
        "--dtype", "bfloat16",
        "--moe-runner-backend", "triton",
        "--mem-fraction-static", "0.5",
        "--max-running-requests", "48",
    ]  # fmt: skip
    assert specs["engine-0"].argv[specs["engine-0"].argv.index("--base-gpu-id") + 1] == "0"
    assert specs["trainer"].env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    ro.data_parallel = 2
    argv = build_local_plan(cfg, RUN, base_env={})[0].argv
    assert argv[argv.index("--attn-dp-size") + 1] == "2" and "--dp-size" not in argv
    cfg.parallel.train.nproc_per_node = 6
    with pytest.raises(ValueError, match="leave 4 of 8 GPUs.*nproc_per_node=6"):
        build_local_plan(cfg, RUN, base_env={})
    cfg.parallel.colocate = True  # engines and trainer share the GPUs
    assert "CUDA_VISIBLE_DEVICES" not in by_name(build_local_plan(cfg, RUN, base_env={}))["trainer"].env


def test_nodes_on_one_machine_split_its_cores_between_all_of_them(monkeypatch):
    """Two loopback nodes (a trainer node, an engine node): each process gets the threads it would get in
    the one-node run, so both runs compute the same numbers."""
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    cfg = Config()
    cfg.algo.async_rollout = True  # engines and trainer work at once: each keeps a share of the cores
    one_node = {s.name: s.env["OMP_NUM_THREADS"] for s in build_local_plan(cfg, RUN, base_env={})}
    assert one_node == {"engine-0": "4", "trainer": "4"}
    cfg.cluster.nnodes, cfg.cluster.node_addrs, cfg.parallel.rollout.nnodes = 2, ["127.0.0.1"] * 2, 1
    for node, name in ((0, "trainer"), (1, "engine-0")):
        cfg.cluster.node_rank = node
        specs = build_local_plan(cfg, RUN, base_env={})
        assert [(s.name, s.env["OMP_NUM_THREADS"]) for s in specs] == [(name, one_node[name])]
    cfg.cluster.node_addrs = ["10.0.0.1", "10.0.0.2"]  # two machines: each node's cores are its own
    cfg.engine.host = "0.0.0.0"
    assert build_local_plan(cfg, RUN, base_env={})[0].env["OMP_NUM_THREADS"] == "8"


def test_disaggregated_nodes():
    cfg = Config()
    cfg.cluster.nnodes, cfg.cluster.gpus_per_node, cfg.cluster.master_addr = 4, 8, "10.0.0.1"
    cfg.engine.host = "0.0.0.0"
    pt, ro = cfg.parallel.train, cfg.parallel.rollout
    pt.nnodes, pt.nproc_per_node = 2, 8
    ro.engine, ro.nnodes, ro.num_engines, ro.gpus_per_engine, ro.tensor_parallel = "sglang", 2, 4, 4, 4
    cfg.cluster.node_rank = 1
    node1 = build_local_plan(cfg, RUN, base_env={})
    assert [s.name for s in node1] == ["trainer"]
    argv = node1[0].argv
    assert argv[argv.index("--node-rank") + 1] == "1" and argv[argv.index("--master-addr") + 1] == "10.0.0.1"
    cfg.cluster.node_rank = 3
    node3 = build_local_plan(cfg, RUN, base_env={})
    assert [s.name for s in node3] == ["engine-2", "engine-3"]
    assert [s.argv[s.argv.index("--port") + 1] for s in node3] == ["30000", "30001"]
    assert [s.argv[s.argv.index("--base-gpu-id") + 1] for s in node3] == ["0", "4"]
    with pytest.raises(ConfigError, match=r"node_addrs lists 0 address\(es\) but cluster.nnodes=4"):
        engine_urls(cfg)
    cfg.cluster.node_rank = 4
    with pytest.raises(ValueError, match="node_rank=4 is outside 0..3"):
        build_local_plan(cfg, RUN, base_env={})


def test_engine_spanning_nodes_is_refused():
    cfg = Config()
    cfg.cluster.gpus_per_node = 8
    cfg.parallel.rollout.engine = RolloutEngineKind.sglang
    cfg.parallel.rollout.gpus_per_engine = 16
    with pytest.raises(ValueError, match="gpus_per_engine=16 > cluster.gpus_per_node=8"):
        build_local_plan(cfg, RUN, base_env={})


def _ports_cfg(engines: int = 2) -> Config:
    cfg = Config()
    cfg.parallel.rollout.num_engines = engines
    cfg.engine.port, cfg.cluster.master_port, cfg.cluster.weight_sync_port = free_ports(3)
    return cfg


def test_ports_free_passes():
    cfg = _ports_cfg(engines=1)
    check_ports(cfg)


@pytest.mark.parametrize(
    ("which", "key"),
    [("engine1", "engine.port="), ("master", "cluster.master_port="), ("sync", "cluster.weight_sync_port=")],
)
def test_busy_port_is_named_with_override(which, key):
    cfg = _ports_cfg(engines=2)
    port = {
        "engine1": cfg.engine.port + 1,
        "master": cfg.cluster.master_port,
        "sync": cfg.cluster.weight_sync_port,
    }[which]
    with socket.socket() as holder:
        try:
            holder.bind(("127.0.0.1", port))
        except OSError:
            pytest.skip(f"port {port} taken meanwhile")
        holder.listen()
        assert not port_is_free("127.0.0.1", port)
        with pytest.raises(PortInUse, match=rf"port {port} on .* is already in use.*e\.g\. {key}\d+") as info:
            check_ports(cfg)
    assert info.value.port == port
    suggested = int(str(info.value).rsplit("=", 1)[1])
    assert suggested != (cfg.engine.port if which == "engine1" else port)


def test_port_clash_inside_the_plan():
    cfg = _ports_cfg(engines=2)
    cfg.cluster.master_port = cfg.engine.port + 1
    with pytest.raises(ValueError, match=r"planned twice: engine 1: engine.port \+ 1 and torchrun master"):
        check_ports(cfg)


def _four_nodes() -> Config:
    """The reference layout: nodes 0-1 train, nodes 2-3 run two 4-GPU engines each."""
    cfg = Config()
    cfg.cluster.nnodes, cfg.cluster.gpus_per_node, cfg.cluster.master_addr = 4, 8, "gpu-a01"
    cfg.cluster.node_addrs = ["gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04"]
    cfg.engine.host, cfg.engine.port = "0.0.0.0", 31000
    pt, ro = cfg.parallel.train, cfg.parallel.rollout
    pt.nnodes, pt.nproc_per_node = 2, 8
    ro.engine, ro.nnodes, ro.num_engines, ro.gpus_per_engine, ro.tensor_parallel = "sglang", 2, 4, 4, 4
    return cfg


def test_multi_node_engine_urls_use_node_addrs():
    cfg = _four_nodes()
    assert engine_placement(cfg) == [(2, 0), (2, 1), (3, 0), (3, 1)]
    urls = ["http://gpu-a03:31000", "http://gpu-a03:31001", "http://gpu-a04:31000", "http://gpu-a04:31001"]
    assert engine_urls(cfg) == urls
    for node in (0, 1):  # every trainer node gets the URLs and waits for every (remote) engine
        cfg.cluster.node_rank = node
        (trainer,) = build_local_plan(cfg, RUN, base_env={})
        assert remote_engine_health(cfg) == [
            (f"engine-{i}", f"{u}/health_generate") for i, u in enumerate(urls)
        ]
        # nodes share the run dir: per-node config and trainer log
        assert trainer.argv[-1] == f"/runs/r1/config-node{node}.yaml"
        assert trainer.log_path == RUN / "logs" / f"trainer-node{node}.log"
        assert trainer.meta["gpus"] == "0..7"
    cfg.cluster.node_rank = 2
    assert remote_engine_health(cfg) == []  # a rollout node waits for nobody
    engines = build_local_plan(cfg, RUN, base_env={})
    assert [e.health_url for e in engines] == [  # its own supervisor probes its engines locally
        "http://127.0.0.1:31000/health_generate",
        "http://127.0.0.1:31001/health_generate",
    ]


def test_shared_multi_node_layout_and_ipv6():
    cfg = Config()
    cfg.cluster.nnodes, cfg.cluster.node_addrs = 2, ["fd00::1", "fd00::2"]
    cfg.parallel.train.nnodes, cfg.parallel.rollout.num_engines = 2, 3
    cfg.engine.host = "::"
    assert engine_urls(cfg) == ["http://[fd00::1]:30000", "http://[fd00::1]:30001", "http://[fd00::2]:30000"]
    cfg.cluster.node_rank = 1  # its own engine is local; node 0's two are remote
    assert [n for n, _ in remote_engine_health(cfg)] == ["engine-0", "engine-1"]


def test_single_node_urls_unchanged():
    cfg = Config()
    cfg.parallel.rollout.num_engines = 2
    cfg.engine.host = "0.0.0.0"
    assert engine_urls(cfg) == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    assert remote_engine_health(cfg) == []
    cfg.engine.host = "10.1.2.3"
    assert engine_urls(cfg)[1] == "http://10.1.2.3:30001"
    (trainer,) = [s for s in build_local_plan(cfg, RUN, base_env={}) if s.role == "trainer"]
    assert trainer.argv[-1] == "/runs/r1/config.yaml" and trainer.log_path.name == "trainer.log"


# --- SGLang's environment, seeds, admin key, timeouts, attention-DP ports -------------------------------
def test_sglang_engines_run_in_engine_python_with_the_timeout_hook(tmp_path):
    cfg = Config()
    cfg.parallel.rollout.engine = RolloutEngineKind.sglang
    cfg.engine.python = str(tmp_path / "sglang-env" / "bin" / "python")
    cfg.sync.timeout_s = 321.0
    (engine, trainer) = build_local_plan(cfg, RUN, base_env={"PYTHONPATH": "/site"})
    assert engine.argv[:3] == [cfg.engine.python, "-m", "sglang.launch_server"]
    assert engine.env[WEIGHT_SYNC_TIMEOUT_ENV] == "321"
    assert engine.env["PYTHONPATH"] == f"{SGLANG_SITE}:/site"
    assert trainer.argv[0] == sys.executable  # the trainer stays in dsv4rl's environment
    cfg.parallel.rollout.engine = RolloutEngineKind.reference
    (engine, _) = build_local_plan(cfg, RUN, base_env={})
    assert engine.argv[0] == sys.executable and engine.env[WEIGHT_SYNC_TIMEOUT_ENV] == "321"
    assert "PYTHONPATH" not in engine.env


@pytest.mark.parametrize("kind", ["reference", "sglang"])
def test_reproducible_sampling_turns_on_deterministic_inference(kind):
    cfg = Config()
    cfg.parallel.rollout.engine = kind
    assert "--enable-deterministic-inference" not in build_local_plan(cfg, RUN, base_env={})[0].argv
    cfg.engine.reproducible_sampling = True
    assert "--enable-deterministic-inference" in build_local_plan(cfg, RUN, base_env={})[0].argv


@pytest.mark.parametrize("kind", ["reference", "sglang"])
def test_replays_make_the_engines_return_their_choices(kind):
    cfg = Config()
    cfg.parallel.rollout.engine = kind
    flags = ("--enable-return-routed-experts", "--enable-return-indexer-topk")
    assert not set(flags) & set(build_local_plan(cfg, RUN, base_env={})[0].argv)
    cfg.algo.routing_replay = True
    argv = build_local_plan(cfg, RUN, base_env={})[0].argv
    assert flags[0] in argv and flags[1] not in argv
    cfg.algo.indexer_replay = True
    assert set(flags) <= set(build_local_plan(cfg, RUN, base_env={})[0].argv)


@pytest.mark.parametrize("kind", ["reference", "sglang"])
def test_engines_beyond_loopback_get_the_keys_file(kind):
    cfg = Config()
    cfg.parallel.rollout.engine = kind
    engine, trainer = build_local_plan(cfg, RUN, base_env={})
    assert "--config" not in engine.argv
    cfg.engine.host = "0.0.0.0"
    engine, trainer = build_local_plan(cfg, RUN, base_env={})
    key_file = str(RUN / "engine-keys.yaml")
    assert engine.argv[engine.argv.index("--config") + 1] == key_file
    assert "secret" not in " ".join(engine.argv) and "--admin-api-key" not in engine.argv


def test_attention_dp_engines_on_one_node_never_share_a_port():
    cfg = Config()
    ro = cfg.parallel.rollout
    ro.engine, ro.num_engines, ro.gpus_per_engine, ro.tensor_parallel, ro.data_parallel = "sglang", 4, 2, 2, 2
    cfg.cluster.gpus_per_node, cfg.parallel.train.nproc_per_node = 8, 1
    cfg.parallel.colocate = True
    engines = [s for s in build_local_plan(cfg, RUN, base_env={}) if s.role == "engine"]
    ports = [int(s.argv[s.argv.index("--port") + 1]) for s in engines]
    assert ports == [30000, 30010, 30020, 30030]
    assert engine_urls(cfg)[1] == "http://127.0.0.1:30010"
    planned = planned_ports(cfg)
    assert len({p.port for p in planned}) == len(planned)  # no port twice
    for port in ports:  # SGLang's ZMQ ports of each engine are reserved
        assert {port + extra for extra in range(233, 241)} <= {p.port for p in planned}
    ro.data_parallel = 1
    assert [p.port for p in planned_ports(cfg) if "engine" in p.what] == [30000, 30001, 30002, 30003]


def test_a_busy_attention_dp_port_is_named(monkeypatch):
    cfg = Config()
    ro = cfg.parallel.rollout
    ro.engine, ro.data_parallel = "sglang", 2
    cfg.engine.port = free_port()
    busy = cfg.engine.port + 235
    monkeypatch.setattr("dsv4rl.launcher.plan.port_is_free", lambda host, port: port != busy)
    with pytest.raises(PortInUse, match=rf"port {busy} .*attention DP, port \+ 235.*engine.port="):
        check_ports(cfg)


def test_plan_shows_the_training_layout_of_the_reference_run() -> None:
    """dapo_math: Megatron TP1/PP4/EP4 over 16 ranks, 43 layers as 11+11+11+10, full recompute, the whole
    optimizer offloaded (the reference run's layout)."""
    from dsv4rl.config.compose import compose
    from dsv4rl.launcher.plan_view import cluster_plan

    layout = cluster_plan(compose("dapo_math", []), nodes=[0])["training"]
    layout.pop("weight_sync_sources")  # test_each_pipeline_stage_sends_from_its_first_rank
    assert layout == {
        "backend": "megatron",
        "world_size": 16,
        "tensor_parallel": 1,
        "pipeline_parallel": 4,
        "stage_layers": [11, 11, 11, 10],
        "expert_parallel": 4,
        "expert_tensor_parallel": 1,
        "data_parallel": 4,
        "recompute": "full",
        "optimizer_cpu_offload": True,
        "optimizer_offload_fraction": 1.0,
        "weight_sync_transport": "broadcast",
    }


def test_each_pipeline_stage_sends_from_its_first_rank() -> None:
    """dapo_math: 16 trainer ranks on nodes 0-1, PP4: stages leave from ranks 0, 4, 8, 12, each with its own
    group name and port on its own node; each node listens on the ports of its own sources."""
    from dsv4rl.config.compose import compose
    from dsv4rl.launcher.plan_view import cluster_plan

    addrs = ["n0", "n1", "n2", "n3"]
    cfg = compose("dapo_math", [f"cluster.node_addrs=[{','.join(addrs)}]", "cluster.master_addr=n0"])
    sources = cluster_plan(cfg, nodes=[0])["training"]["weight_sync_sources"]
    assert [
        (s["stage"], s["rank"], s["node"], s["address"], s["port"], s["group_name"]) for s in sources
    ] == [
        (0, 0, 0, "n0", 29600, "weight_update_group"),
        (1, 4, 0, "n0", 29601, "weight_update_group-pp1"),
        (2, 8, 1, "n1", 29602, "weight_update_group-pp2"),
        (3, 12, 1, "n1", 29603, "weight_update_group-pp3"),
    ]
    listens = {}
    for node in range(4):
        cfg.cluster.node_rank = node
        listens[node] = sorted(p.port for p in planned_ports(cfg) if p.key == "cluster.weight_sync_port")
    assert listens == {0: [29600, 29601], 1: [29602, 29603], 2: [], 3: []}
    cfg.cluster.node_rank = 1
    (stage2,) = [p for p in planned_ports(cfg) if p.port == 29602]
    assert stage2.what == "weight sync of pipeline stage 2" and stage2.offset == 2


def test_fsdp_sends_everything_from_rank_0() -> None:
    from dsv4rl.topology import weight_sync_sources

    cfg = Config()
    assert [(s.stage, s.rank, s.port, s.group_name) for s in weight_sync_sources(cfg)] == [
        (0, 0, cfg.cluster.weight_sync_port, "weight_update_group")
    ]


def test_slurm_header_and_algorithm_come_from_the_recipe():
    from dsv4rl.config.compose import compose
    from dsv4rl.launcher.plan_view import cluster_plan

    cfg = compose(
        "dapo_math", ["cluster.partition=gpu", "cluster.account=proj1", "cluster.time_limit=48:00:00"]
    )
    plan = cluster_plan(cfg, [0])
    assert plan["algorithm"] == "grpo"
    assert plan["slurm"] == [
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj1",
        "#SBATCH --time=48:00:00",
    ]
    assert cluster_plan(compose("tiny_arith"), [0])["slurm"] is None


def test_plan_shows_the_staleness_bound_and_the_batches_it_holds():
    from rich.console import Console

    from dsv4rl.config.compose import compose
    from dsv4rl.launcher.plan_view import cluster_plan, render_plan

    def shown(overrides: list[str]) -> tuple[dict, str]:
        plan = cluster_plan(compose("tiny_arith", overrides), [0])
        console = Console(record=True, width=400)
        render_plan(plan, console)
        return plan["rollout"], console.export_text()

    rollout, text = shown([])
    assert (rollout["max_staleness"], rollout["batch_samples"]) == (0, 512)
    assert "loop: synchronous (algo.max_staleness=0)" in text
    rollout, text = shown(["algo.async_rollout=true", "algo.tis.enabled=true"])
    assert rollout["max_staleness"] == 1
    assert "1 step(s) off-policy (algo.max_staleness=1)" in text and "1 batch(es) of 512 samples" in text
    assert (rollout["loop"], rollout["held_samples"], rollout["pause_mode"]) == (
        "one_step_off_policy",
        512,
        None,
    )
    rollout, text = shown(["algo.max_staleness=2", "sync.pause_mode=in_place"])
    assert (rollout["loop"], rollout["held_samples"], rollout["pause_mode"]) == (
        "fully_async",
        1536,
        "in_place",
    )
    assert "loop: fully asynchronous (algo.max_staleness=2)" in text and "up to 1536 samples" in text
    assert "sync.pause_mode=in_place" in text
    rollout, _ = shown(["algo.max_staleness=2", "algo.oversample.factor=1.5"])  # 1.5 x the groups running
    assert rollout["held_samples"] == 2304


# ------------------------------------------------------------------------------------------- MoE path, dtype
def _engine_argvs(cfg: Config) -> list[list[str]]:
    return [
        spec.argv
        for node in range(cfg.cluster.nnodes)
        for spec in build_local_plan(_on_node(cfg, node), RUN, base_env={}, model_path="/m")
        if spec.role == "engine"
    ]


def _on_node(cfg: Config, node: int) -> Config:
    import copy

    c = copy.deepcopy(cfg)
    c.cluster.node_rank = node
    return c


def _flag(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, (flag, argv)
    return argv[argv.index(flag) + 1]


def test_a_fully_asynchronous_in_place_run_starts_sglang_without_the_radix_cache() -> None:
    """K >= 2 with in_place: pushes cannot flush the prefix cache while requests are held, so SGLang runs
    without it (else new requests reuse prefix KV of the old weights); retract flushes, K = 1 pushes idle
    engines: both keep it."""
    from dsv4rl.config.compose import compose

    def radix_off(*overrides: str) -> set[bool]:
        cfg = compose("dapo_math", ["cluster.node_addrs=[a,b,c,d]", *overrides])
        return {"--disable-radix-cache" in argv for argv in _engine_argvs(cfg)}

    assert radix_off("algo.max_staleness=2", "sync.pause_mode=in_place") == {True}
    assert radix_off("algo.max_staleness=2", "sync.pause_mode=retract") == {False}
    assert radix_off("sync.pause_mode=in_place") == {False}  # dapo_math: K = 1


def test_every_sglang_engine_of_the_reference_run_gets_dtype_and_moe_backend() -> None:
    """dapo_math (MI355X, aiter, fp8_rollout from the MXFP4 release): SGLang asserts auto under
    SGLANG_DSV4_FP4_DEQUANT=1; auto resolves to aiter, whose re-shuffle is not idempotent, so the plan says
    a failed push needs fresh engines. The JSON plan shows it on every engine (the issue's acceptance)."""
    from dsv4rl.config.compose import compose
    from dsv4rl.launcher.plan_view import cluster_plan

    cfg = compose("dapo_math", ["cluster.node_addrs=[a,b,c,d]"])
    argvs = _engine_argvs(cfg)
    assert len(argvs) == 2
    assert {(_flag(a, "--dtype"), _flag(a, "--moe-runner-backend")) for a in argvs} == {("bfloat16", "auto")}
    plan = cluster_plan(cfg, nodes=range(4))
    engines = [p for node in plan["nodes"] for p in node["processes"] if p["role"] == "engine"]
    assert len(engines) == 2
    for engine in engines:
        moe = engine["moe"]
        assert engine["dtype"] == "bfloat16" and moe["moe_runner_backend"] == "auto"
        assert (moe["device_family"], moe["aiter"], moe["resolves_to"]) == ("cdna4", True, "aiter")
        held = (moe["experts"], moe["expert_scale_dtype"], moe["linear_scale_dtype"])
        assert held == ("fp8", "float32", "float32")
        assert moe["idempotent"] is False and moe["updatable"] is True and moe["restart_on_failed_push"]
        assert "sglang/srt/layers/quantization/fp8.py:" in moe["source"]
    assert [e["moe_runner_backend"] for e in plan["engines"]] == ["auto"] * 2
    assert "restarted" not in plan["engine"]["restart_on_failed_push"]  # the reason; the view adds the rule
    assert "not idempotent" in plan["engine"]["restart_on_failed_push"]


@pytest.mark.parametrize(
    ("overrides", "backend", "resolves", "idempotent"),
    [
        (["cluster.device=h200"], "auto", "triton", True),  # de-quantized once, kept in its Parameters
        (["quant=bf16"], "triton", "triton", True),  # no aiter shuffle under triton
        (["cluster.device=h200", "~quant.engine_env.SGLANG_DSV4_FP4_DEQUANT",
          "+quant.engine_env.SGLANG_DSV4_FP4_EXPERTS=0"], "triton", "triton", True),  # an FP8 checkpoint
        (["+quant.engine_env.SGLANG_USE_AITER=0"], "auto", "triton", True),  # MI355X without aiter
        (["cluster.device=cpu", "cluster.gpus_per_node=0"], "auto", None, None),  # the GPU is not named
    ],
)  # fmt: skip
def test_the_moe_backend_follows_quant_and_device(overrides, backend, resolves, idempotent) -> None:
    from dsv4rl.config.compose import compose
    from dsv4rl.launcher.plan_view import cluster_plan

    cfg = compose("dapo_math", ["cluster.node_addrs=[a,b,c,d]", *overrides])
    assert {_flag(a, "--moe-runner-backend") for a in _engine_argvs(cfg)} == {backend}
    moe = cluster_plan(cfg, nodes=[2])["engine"]["moe"]
    got = (moe["moe_runner_backend"], moe["resolves_to"], moe["idempotent"])
    assert got == (backend, resolves, idempotent)


def test_engine_dtype_reaches_sglang_only() -> None:
    cfg = Config(seed=1)
    cfg.engine.dtype = Dtype.float32
    assert "--dtype" not in build_local_plan(cfg, RUN, base_env={})[0].argv  # the reference engine
    cfg.parallel.rollout.engine = RolloutEngineKind.sglang
    cfg.parallel.rollout.gpus_per_engine, cfg.cluster.gpus_per_node = 1, 2
    assert _flag(build_local_plan(cfg, RUN, base_env={})[0].argv, "--dtype") == "float32"


def test_a_recipe_no_moe_backend_can_update_is_not_planned() -> None:
    from dsv4rl.config.compose import compose

    cfg = compose("dapo_math", ["quant=fp8_mxfp4", "cluster.device=h200", "cluster.node_rank=2",
                                "cluster.node_addrs=[a,b,c,d]"])  # fmt: skip
    with pytest.raises(ValueError, match="flashinfer_mxfp4.*SGLANG_DSV4_FP4_DEQUANT=1"):
        build_local_plan(cfg, RUN, base_env={})


def test_reference_engines_rehearse_a_non_idempotent_sglang_path() -> None:
    """A reference engine standing in for SGLang on MI355X with aiter emulates its post-processing."""
    from dsv4rl.config.compose import compose

    cfg = compose("dapo_math", ["parallel.rollout.engine=reference", "cluster.node_rank=2",
                                "cluster.node_addrs=[a,b,c,d]"])  # fmt: skip
    argv = build_local_plan(cfg, RUN, base_env={})[0].argv
    assert argv[1:3] == ["-m", "dsv4rl.engine"] and "--emulate-non-idempotent-postprocess" in argv
    assert "--emulate-non-idempotent-postprocess" not in build_local_plan(Config(), RUN, base_env={})[0].argv
    cfg.engine.extra_args = ["--emulate-non-idempotent-postprocess"]  # asked for as well: passed once
    assert build_local_plan(cfg, RUN, base_env={})[0].argv.count("--emulate-non-idempotent-postprocess") == 1
