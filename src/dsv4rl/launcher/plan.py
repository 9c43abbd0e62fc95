"""The processes this node runs for a recipe: rollout engines and the trainer, with commands, env and ports.

A plan is data (`ProcessSpec`s), built and checked before anything starts, so `dsv4rl plan` can print it
and tests can check the exact commands. Node layout: with `parallel.rollout.nnodes == 0` (or colocated),
every node runs trainer ranks and an even share of the engines; otherwise (disaggregated) nodes
`0 .. train.nnodes-1` train and the next `rollout.nnodes` nodes serve rollouts.

SGLang engines run in their own interpreter (`engine.python`, see `engine_python`), take the weight-update
group's timeout from `sync.timeout_s` (through `engine/sglang_site`), and, when they listen beyond
loopback, the run's api and admin keys (see `engine_keys`). They get `--dtype` (`engine.dtype`) and the
MoE runner backend whose weight updates work on `cluster.device` (`dsv4rl.quant.sglang_moe`); reference
engines rehearsing a recipe whose SGLang path is not idempotent emulate it.

Multi-node runs share `run.dir` (a filesystem every node mounts): each node writes its own config
(`config-node<r>.yaml`) and trainer log (`logs/trainer-node<r>.log`); engine logs are named by the
engine's global index. Engines are found at `http://<cluster.node_addrs[node]>:<engine_port(local)>`.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dsv4rl.algo.staleness import staleness_bound
from dsv4rl.config.choices import (
    EngineNumerics,
    ModelArchitecture,
    ProcessRole,
    RolloutEngineKind,
    SyncTransport,
    Task,
)
from dsv4rl.config.schema import Config
from dsv4rl.config.sglang_choices import PauseMode
from dsv4rl.engine_client.engine_keys import engine_keys_file, engines_need_keys
from dsv4rl.launcher.engine_python import engine_python
from dsv4rl.quant import sglang_moe
from dsv4rl.topology import (
    WILDCARD,
    engine_port,
    engine_port_layout,
    engines_on_node,
    on_one_machine,
    sync_transport,
    topology,
    weight_sync_sources,
)
from dsv4rl.topology import url_host as _url_host

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"  # one node; several: config-node<r>.yaml (see config_path)
WEIGHT_SYNC_TIMEOUT_ENV = "DSV4RL_WEIGHT_SYNC_TIMEOUT_S"  # read by the reference engine and sglang_site
TRAINER_PROCESS = "trainer"  # the training ranks' process name (their heartbeats: trainer-rank<r>)
SGLANG_SITE = Path(__file__).resolve().parents[1] / "engine" / "sglang_site"


@dataclass
class ProcessSpec:
    """One child process of the node supervisor."""

    name: str  # unique on the node: "engine-0", "trainer"
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    role: ProcessRole
    health_url: str | None = None  # GET until 200 before the trainer starts (engines)
    meta: dict[str, str] = field(default_factory=dict)  # what a plan printout shows (gpus, port, ...)


class PortInUse(RuntimeError):
    """Ports the plan needs are taken. The message names every one (`more`: the others, as (port, host,
    what)), its use and the overrides that move them (`override`: `key=value`, space-separated)."""

    def __init__(
        self, port: int, host: str, what: str, override: str, more: Sequence[tuple[int, str, str]] = ()
    ):
        self.port, self.host, self.what, self.override = port, host, what, override
        self.busy = [(port, host, what), *more]
        if not more:
            super().__init__(
                f"port {port} on {host} ({what}) is already in use; stop whatever listens there "
                f"(`ss -ltnp 'sport = :{port}'` shows it) or choose another port, e.g. {override}"
            )
            return
        names = ", ".join(f"{p} on {h} ({w})" for p, h, w in self.busy)
        query = " or ".join(f"sport = :{p}" for p, _, _ in self.busy)
        super().__init__(
            f"{len(self.busy)} ports are already in use: {names}; stop whatever listens there "
            f"(`ss -ltnp '( {query} )'` shows it) or choose other ports, e.g. {override}"
        )


@dataclass(frozen=True)
class PlannedPort:
    port: int
    host: str
    what: str
    key: str  # the config key that moves it: engine.port, cluster.master_port, ...
    offset: int = 0  # port = <key> + offset


def model_dir(cfg: Config) -> Path:
    """What engines and trainer load: `model.path`, or `<run.dir>/model` materialized from the seed."""
    return Path(cfg.model.path) if cfg.model.path else Path(cfg.run.dir) / "model"


# ------------------------------------------------------------------------------------------- layout
# Where things live is `dsv4rl.topology`'s answer; these are the planner's views of it.
def trainer_nodes(cfg: Config) -> list[int]:
    return topology(cfg).trainer_nodes()


def engine_placement(cfg: Config) -> list[tuple[int, int]]:
    """(node rank, local index) of every engine, by global index."""
    return [(engine.node, engine.local) for engine in topology(cfg).engines]


def engine_urls(cfg: Config) -> list[str]:
    """Base URLs of every engine, by global index; ConfigError when cluster.node_addrs misses a node."""
    return topology(cfg).engine_urls()


def remote_engine_health(cfg: Config) -> list[tuple[str, str]]:
    """(name, /health_generate URL) of the engines a trainer node waits for that run on other nodes."""
    layout = topology(cfg)
    layout.engine_urls()  # raises, naming the fix, while an engine's node has no address
    return [(e.name, f"{e.url}/health_generate") for e in layout.remote_engines(cfg.cluster.node_rank)]


def config_path(cfg: Config, run_dir: Path) -> Path:
    """The resolved config this node's trainer reads; per node when nodes share the run dir."""
    if cfg.cluster.nnodes <= 1:
        return Path(run_dir) / CONFIG_FILE
    return Path(run_dir) / f"config-node{cfg.cluster.node_rank}.yaml"


def trainer_log_name(cfg: Config) -> str:
    return "trainer.log" if cfg.cluster.nnodes <= 1 else f"trainer-node{cfg.cluster.node_rank}.log"


# ------------------------------------------------------------------------------------------- env
def _base_env(cfg: Config, base_env: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ if base_env is None else base_env)
    env.update({str(k): str(v) for k, v in cfg.comm.env.items()})
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _cpu_threads(
    cfg: Config, env: dict[str, str], engines: int, trainer_ranks: int
) -> tuple[dict[str, str], dict[str, str]]:
    """On CPU, the environments of (the engines, the trainer ranks) with their OpenMP threads; a set
    OMP_NUM_THREADS wins. With every node on this machine, counted over all nodes' processes (the same
    threads, so the same numbers, as on one node).

    The synchronous loop takes turns: the trainer waits while the engines generate and the engines idle
    while it trains, so each side splits every core between its own processes (more threads make both the
    training and the generation faster). Async rollouts overlap the two, and OpenMP threads of one process
    spin while another's want the cores (much slower when each takes every core), so every process keeps
    an equal share."""
    if cfg.cluster.gpus_per_node > 0 or "OMP_NUM_THREADS" in env:
        return env, env
    if on_one_machine(cfg):
        pt = cfg.parallel.train
        engines, trainer_ranks = cfg.parallel.rollout.num_engines, pt.nnodes * pt.nproc_per_node
    cores = os.cpu_count() or 1
    if staleness_bound(cfg.algo) > 0 or not engines or not trainer_ranks:
        shared = max(1, cores // max(1, engines + trainer_ranks))
        return _with_threads(env, shared), _with_threads(env, shared)
    return _with_threads(env, max(1, cores // engines)), _with_threads(env, max(1, cores // trainer_ranks))


def _with_threads(env: dict[str, str], threads: int) -> dict[str, str]:
    return {**env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


# ------------------------------------------------------------------------------------------- commands
def _shared_engine_flags(cfg: Config, run_dir: Path) -> list[str]:
    """Flags both engine kinds take with SGLang's meaning: reproducible sampling, the replays' returns, the
    run's keys, and when colocated the memory saver (without it SGLang's /release_memory_occupation frees
    nothing)."""
    flags = ["--enable-deterministic-inference"] if cfg.engine.reproducible_sampling else []
    if cfg.algo.routing_replay:  # the engines return their expert choices (docs/sglang.md)
        flags.append("--enable-return-routed-experts")
    if cfg.algo.indexer_replay:  # and their CSA indexer top-k
        flags.append("--enable-return-indexer-topk")
    if cfg.engine.fp32_lm_head:
        flags.append("--enable-fp32-lm-head")
    if cfg.parallel.colocate:
        flags.append("--enable-memory-saver")
    if engines_need_keys(cfg):
        flags += ["--config", str(engine_keys_file(run_dir))]  # {api-key, admin-api-key}, mode 0600
    return flags


def numerics_flags(cfg: Config) -> list[str]:
    """The reference engine's own rounding flags (`engine.numerics`, `engine.numerics_features`)."""
    flags = ["--numerics", cfg.engine.numerics.value] if cfg.engine.numerics != EngineNumerics.exact else []
    if cfg.engine.numerics_features is not None:
        flags += ["--numerics-features", ",".join(str(f) for f in cfg.engine.numerics_features)]
    return flags


def reference_engine_argv(cfg: Config, model_path: str, port: int, seed: int, run_dir: Path) -> list[str]:
    """The reference engine; with `--emulate-non-idempotent-postprocess` (its own flag, not SGLang's) when
    the recipe's SGLang path would re-lay out weights at every session's end."""
    given = sglang_moe.EMULATE_FLAG in (str(arg) for arg in cfg.engine.extra_args)  # appended as given
    emulate = [sglang_moe.EMULATE_FLAG] if sglang_moe.emulates_non_idempotent(cfg) and not given else []
    return [
        sys.executable, "-m", "dsv4rl.engine",
        "--model-path", model_path,
        "--host", cfg.engine.host,
        "--port", str(port),
        "--random-seed", str(seed),
        "--max-batch-size", str(cfg.engine.max_batch_size),
        *emulate,
        *numerics_flags(cfg),
        *_shared_engine_flags(cfg, run_dir),
    ]  # fmt: skip


def sglang_argv(
    cfg: Config, model_path: str, port: int, seed: int, base_gpu_id: int, run_dir: Path
) -> list[str]:
    """`<engine.python> -m sglang.launch_server` with SGLang 0.5.23's flags (checked against
    `dsv4rl/engine/sglang_contract.json` by the tests): `--dtype`, and the MoE runner backend of
    `sglang_moe`'s table (ValueError when no backend takes updates; validation refuses that recipe first)."""
    ro = cfg.parallel.rollout
    moe = sglang_moe.recipe_moe_path(cfg)
    refusal = sglang_moe.moe_refusal(cfg)
    if refusal:
        raise ValueError(refusal)
    gpus_per_node = cfg.cluster.gpus_per_node
    if gpus_per_node and ro.gpus_per_engine > gpus_per_node:
        raise ValueError(
            f"parallel.rollout.gpus_per_engine={ro.gpus_per_engine} > cluster.gpus_per_node={gpus_per_node}: "
            "engines spanning nodes (--nnodes/--dist-init-addr) are not planned yet; keep engines in a node"
        )
    argv = [
        engine_python(cfg), "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--host", cfg.engine.host,
        "--port", str(port),
        "--tp-size", str(ro.tensor_parallel),
        "--ep-size", str(ro.expert_parallel),
        "--base-gpu-id", str(base_gpu_id),
        "--random-seed", str(seed),
        "--watchdog-timeout", f"{ro.watchdog_timeout_s:g}",
        "--dtype", cfg.engine.dtype.value,
        "--moe-runner-backend", moe.backend.value,
    ]  # fmt: skip
    if ro.data_parallel > 1:
        # Attention DP inside the TP group; `--dp-size` replicas would break weight updates (dp_size == 1).
        argv += ["--attn-dp-size", str(ro.data_parallel)]
    if ro.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", f"{ro.mem_fraction_static:g}"]
    if ro.max_running_requests is not None:
        argv += ["--max-running-requests", str(ro.max_running_requests)]
    if cfg.model.architecture == ModelArchitecture.deepseek_v41:
        # V4.1's serving shortcut (on by default where supported) runs the layers after the last KV source
        # on the prompt's tail only; SGLang's help says it is not numerically equal to a full prefill and
        # names this flag for RL rollouts whose log-probs must match the trainer's (arg_groups/fields/
        # exec_.py:170-181)
        argv.append("--no-enable-decoder-swa-bounded-replay")
    if staleness_bound(cfg.algo) >= 2 and cfg.sync.pause_mode == PauseMode.in_place:
        # A push with requests held in place cannot flush the prefix cache (SGLang refuses while a batch
        # runs): new requests would reuse prefix KV the old weights computed. The reference run, fully
        # asynchronous with in_place, ran without the radix cache too.
        argv.append("--disable-radix-cache")
    return argv + _shared_engine_flags(cfg, run_dir)


def sglang_env(cfg: Config, env: Mapping[str, str]) -> dict[str, str]:
    """`quant.engine_env` over the node's env, and the weight-group timeout hook on PYTHONPATH."""
    out = {**env, **{str(k): str(v) for k, v in cfg.quant.engine_env.items()}}
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(SGLANG_SITE), env.get("PYTHONPATH")) if p)
    return out


def trainer_argv(cfg: Config, run_dir: Path, task: Task = Task.train) -> list[str]:
    """torchrun from this interpreter's environment (`python -m dsv4rl.train.torchrun`: torchrun that
    leaves SIGTERM and SIGUSR1 to its ranks, for a graceful stop); `dsv4rl eval` runs one evaluating
    process instead (no trainer: the engines serve the recipe's model)."""
    if task == Task.eval:
        return [sys.executable, "-m", "dsv4rl.eval.worker", "--config", str(config_path(cfg, run_dir))]
    pt = cfg.parallel.train
    task_args = [] if task == Task.train else ["--task", str(task)]
    return [
        sys.executable, "-m", "dsv4rl.train.torchrun",
        "--nnodes", str(pt.nnodes),
        "--node-rank", str(cfg.cluster.node_rank),
        "--nproc-per-node", str(pt.nproc_per_node),
        "--master-addr", cfg.cluster.master_addr,
        "--master-port", str(cfg.cluster.master_port),
        "-m", "dsv4rl.train.worker",
        "--config", str(config_path(cfg, run_dir)),
        *task_args,
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------- the plan
def build_local_plan(
    cfg: Config,
    run_dir: Path,
    base_env: Mapping[str, str] | None = None,
    model_path: str | None = None,
    task: Task = Task.train,
) -> list[ProcessSpec]:
    """Engines first, then the trainer (`task`: train or align; eval: the evaluating process), which waits
    for the engines itself. SGLang engines also get `quant.engine_env`."""
    run_dir = Path(run_dir)
    logs = run_dir / "logs"
    node = cfg.cluster.node_rank
    if not 0 <= node < cfg.cluster.nnodes:
        raise ValueError(f"cluster.node_rank={node} is outside 0..{cfg.cluster.nnodes - 1} (cluster.nnodes)")
    model = str(model_path or (run_dir / "model" if cfg.model.path is None else cfg.model.path))
    engines = engines_on_node(cfg, node)
    evaluating = task == Task.eval  # one evaluating process on node 0 in the trainer's place
    runs_trainer = node == 0 if evaluating else node in trainer_nodes(cfg)
    nproc = (1 if evaluating else cfg.parallel.train.nproc_per_node) if runs_trainer else 0
    env, trainer_threads_env = _cpu_threads(cfg, _base_env(cfg, base_env), len(engines), nproc)
    kind = RolloutEngineKind(cfg.parallel.rollout.engine)
    gpe = cfg.parallel.rollout.gpus_per_engine
    specs: list[ProcessSpec] = []
    for local, global_index in enumerate(engines):
        port = engine_port(cfg, local)
        seed = cfg.seed + global_index
        process_env = {**env, WEIGHT_SYNC_TIMEOUT_ENV: f"{cfg.sync.timeout_s:g}"}
        if kind == RolloutEngineKind.sglang:
            argv = sglang_argv(cfg, model, port, seed, base_gpu_id=local * gpe, run_dir=run_dir)
            process_env = sglang_env(cfg, process_env)
        else:
            argv = reference_engine_argv(cfg, model, port, seed, run_dir)
        host = "127.0.0.1" if cfg.engine.host in WILDCARD else cfg.engine.host
        name = f"engine-{global_index}"
        meta = {"port": str(port), "kind": kind.value, "python": argv[0]}
        if kind == RolloutEngineKind.sglang:
            meta["dtype"] = cfg.engine.dtype.value
            meta["moe_runner_backend"] = sglang_moe.recipe_moe_path(cfg).backend.value
        if cfg.cluster.gpus_per_node:
            meta["gpus"] = f"{local * gpe}..{(local + 1) * gpe - 1}"
        specs.append(
            ProcessSpec(
                name=name,
                argv=argv + [str(a) for a in cfg.engine.extra_args],
                env=process_env,
                log_path=logs / f"{name}.log",
                role=ProcessRole.engine,
                health_url=f"http://{_url_host(host)}:{port}/health_generate",
                meta=meta,
            )
        )
    if runs_trainer:
        # the trainer finds the engines, their keys and its peers from the config (dsv4rl.topology)
        trainer_env = dict(trainer_threads_env)
        meta = {"nproc": str(nproc)}
        gpus = 0 if evaluating else cfg.cluster.gpus_per_node
        if gpus and engines and not cfg.parallel.colocate:
            free = list(range(len(engines) * gpe, gpus))
            if len(free) < nproc:
                raise ValueError(
                    f"node {node}: {len(engines)} engines x {gpe} GPUs leave {len(free)} of {gpus} GPUs, "
                    f"but parallel.train.nproc_per_node={nproc}; colocate, or move engines to rollout nodes"
                )
            trainer_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, free[:nproc]))
            meta["gpus"] = trainer_env["CUDA_VISIBLE_DEVICES"]
        elif gpus:
            meta["gpus"] = f"0..{nproc - 1}"  # torchrun's local ranks, on the node's first GPUs
        specs.append(
            ProcessSpec(
                name=TRAINER_PROCESS,
                argv=trainer_argv(cfg, run_dir, task),
                env=trainer_env,
                log_path=logs / trainer_log_name(cfg),
                role=ProcessRole.trainer,
                meta=meta,
            )
        )
    return specs


# ------------------------------------------------------------------------------------------- ports
def planned_ports(cfg: Config) -> list[PlannedPort]:
    """Every port this node will listen on: its engines, on node 0 torchrun's, and the weight-sync
    groups of the pipeline-stage sources it runs (stage 0's on node 0)."""
    node = cfg.cluster.node_rank
    host = cfg.engine.host
    ports = []
    for local, g in enumerate(engines_on_node(cfg, node)):
        port = engine_port(cfg, local)
        offset = port - cfg.engine.port
        ports.append(PlannedPort(port, host, f"engine {g}: engine.port + {offset}", "engine.port", offset))
        extra_ports = engine_port_layout(cfg)[1]  # SGLang's attention-DP ports (ZMQ over TCP)
        if extra_ports:
            ports += [
                PlannedPort(
                    port + extra, "0.0.0.0", f"engine {g}: attention DP, port + {extra}", "engine.port",
                    offset + extra,
                )
                for extra in extra_ports
            ]  # fmt: skip
    if node == 0:
        ports.append(
            PlannedPort(cfg.cluster.master_port, "0.0.0.0", "torchrun master", "cluster.master_port")
        )
    sources = weight_sync_sources(cfg) if sync_transport(cfg) == SyncTransport.broadcast else []
    for source in sources:  # colocated: tensor handles over HTTP, no group to host
        if source.node == node:
            what = "weight sync" if len(sources) == 1 else f"weight sync of pipeline stage {source.stage}"
            ports.append(PlannedPort(source.port, "0.0.0.0", what, "cluster.weight_sync_port", source.stage))
    return ports


def port_is_free(host: str, port: int) -> bool:
    """True if a server could bind host:port now (SO_REUSEADDR, like uvicorn and TCPStore)."""
    for addr in (host, "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((addr, port))
                return True
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return False
                # EADDRNOTAVAIL / unresolvable: not this machine's address; try the wildcard
    return True


def check_ports(cfg: Config) -> None:
    """Raise PortInUse naming every busy port (or ValueError on a clash inside the plan) before any
    process starts."""
    ports = planned_ports(cfg)
    seen: dict[int, PlannedPort] = {}
    for p in ports:
        if p.port in seen:
            raise ValueError(
                f"port {p.port} is planned twice: {seen[p.port].what} and {p.what}; change {p.key} or "
                f"{seen[p.port].key}"
            )
        seen[p.port] = p
    busy = [p for p in ports if not port_is_free(p.host, p.port)]
    if not busy:
        return
    overrides: dict[str, str] = {}  # one per key: it moves every port under it
    taken: set[int] = set()
    for p in busy:
        if p.key not in overrides:
            overrides[p.key] = _suggest(p, ports, taken)
            moved = overrides[p.key].rpartition("=")[2]
            if moved.isdigit():
                taken |= {int(moved) + q.offset for q in ports if q.key == p.key}
    first, more = busy[0], [(p.port, p.host, p.what) for p in busy[1:]]
    raise PortInUse(first.port, first.host, first.what, " ".join(overrides.values()), more)


def _suggest(
    bad: PlannedPort, ports: list[PlannedPort], taken: set[int] | frozenset[int] = frozenset()
) -> str:
    """`key=value` that moves `bad` (and its siblings under the same key) onto free ports, clear of the
    other keys' ports and of `taken` (where other suggestions move theirs)."""
    group = [p for p in ports if p.key == bad.key]
    others = {p.port for p in ports if p.key != bad.key} | set(taken)
    base = bad.port - bad.offset
    step = 100 if bad.key == "engine.port" else 1
    for k in range(1, 200):
        candidate = base + k * step
        wanted = [candidate + p.offset for p in group]
        if max(wanted) > 65535 or others & set(wanted):
            continue
        if all(port_is_free(bad.host, w) for w in wanted):
            return f"{bad.key}={candidate}"
    return f"{bad.key}=<a free port>"
