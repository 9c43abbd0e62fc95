"""`dsv4rl plan`: the per-node process plan as data (JSON-able) and as rich tables; nothing is started.

For each node: the processes its supervisor would start (the exact argv, the environment the recipe and
the plan set - not the caller's own environment -, ports, GPUs), the engines on other nodes it would wait
for, and the ports it would listen on. Every SGLang engine also shows its `--dtype` and its MoE path: the
runner backend passed, what it resolves to, the expert and linear scale formats SGLang will hold, and
whether its weight post-processing can be repeated (`dsv4rl.quant.sglang_moe`).
"""

from __future__ import annotations

import copy
import math
import shlex
import socket
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from dsv4rl.algo.staleness import staleness_bound
from dsv4rl.config.choices import ClusterKind, ProcessRole, RolloutEngineKind, RolloutMode, SyncTransport
from dsv4rl.config.compose import ConfigError
from dsv4rl.config.reference_run import compare as compare_with_reference
from dsv4rl.config.schema import Config
from dsv4rl.engine_client.engine_keys import ADMIN_KEY_ENV, engine_keys_file, engines_need_keys
from dsv4rl.engine_client.roster import restart_budget
from dsv4rl.faults.failed_push import FAILED_PUSH_EXIT
from dsv4rl.launcher.engine_python import engine_python
from dsv4rl.launcher.estimate_view import (
    memory_json,
    node_memory,
    node_memory_text,
    render_memory,
    render_step_time,
    step_time_json,
)
from dsv4rl.launcher.plan import (
    build_local_plan,
    engine_placement,
    engine_port,
    engine_urls,
    engines_on_node,
    planned_ports,
    remote_engine_health,
    trainer_nodes,
)
from dsv4rl.quant import sglang_moe
from dsv4rl.reward.rewarder import effective_fns
from dsv4rl.topology import data_parallel_size, stage_layers, sync_transport, topology, weight_sync_sources


def _node_cfg(cfg: Config, node: int) -> Config:
    c = copy.deepcopy(cfg)
    c.cluster.node_rank = node
    return c


def node_plan(cfg: Config, run_dir: Path, node: int) -> dict[str, Any]:
    """What node `node`'s supervisor would start and wait for."""
    c = _node_cfg(cfg, node)
    specs = build_local_plan(c, run_dir, base_env={})
    try:
        waits: list[dict[str, str]] | None = [
            {"name": name, "health_url": url} for name, url in remote_engine_health(c)
        ]
    except ConfigError:
        waits = None  # unresolved: cluster.node_addrs missing
    roles = []
    if node in trainer_nodes(c):
        nproc = c.parallel.train.nproc_per_node
        first, last = node * nproc, (node + 1) * nproc - 1
        roles.append(f"trainer (rank {first})" if first == last else f"trainer (ranks {first}..{last})")
    if engines_on_node(c, node):
        roles.append("rollout")
    addrs = c.cluster.node_addrs
    moe = sglang_moe.plan_info(c) if c.parallel.rollout.engine == RolloutEngineKind.sglang else None
    return {
        "node": node,
        "address": addrs[node] if node < len(addrs) else None,
        "roles": roles,
        "processes": [
            {
                "name": s.name,
                "role": s.role,
                "argv": list(s.argv),
                "env": dict(sorted(s.env.items())),
                "port": int(s.meta["port"]) if "port" in s.meta else None,
                "python": s.argv[0],
                "gpus": s.meta.get("gpus"),
                "health_url": s.health_url,
                "log": str(s.log_path),
                # SGLang engines: --dtype and the MoE path (runner, held scale formats, idempotence)
                "dtype": s.meta.get("dtype"),
                "moe": moe if s.role == ProcessRole.engine else None,
            }
            for s in specs
        ],
        "waits_for": waits,
        "listens": [{"port": p.port, "host": p.host, "what": p.what} for p in planned_ports(c)],
    }


def slurm_header(cfg: Config) -> list[str] | None:
    """The `#SBATCH` lines the recipe implies (cluster.kind=slurm): nodes, GPUs and the site's partition,
    account and time limit (`cluster.partition`, `.account`, `.time_limit`), for the batch script."""
    c = cfg.cluster
    if c.kind != ClusterKind.slurm:
        return None
    lines = [f"#SBATCH --nodes={c.nnodes}", "#SBATCH --ntasks-per-node=1"]
    if c.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={c.gpus_per_node}")
    for flag, value in (("partition", c.partition), ("account", c.account), ("time", c.time_limit)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    return lines


def cluster_plan(cfg: Config, nodes: Iterable[int], warnings: list[str] | None = None) -> dict[str, Any]:
    """The plan of `nodes` plus run-wide facts: where each engine lives and its URL (None: unresolved)."""
    run_dir = Path(cfg.run.dir).resolve()
    try:
        urls: list[str | None] = list(engine_urls(cfg))
    except ConfigError:
        urls = [None] * cfg.parallel.rollout.num_engines
    sglang = cfg.parallel.rollout.engine == RolloutEngineKind.sglang
    moe = sglang_moe.plan_info(cfg) if sglang else None
    engines = [
        {
            "index": i, "node": node, "port": engine_port(cfg, local), "url": urls[i],
            "dtype": cfg.engine.dtype.value if sglang else None,
            "moe_runner_backend": moe["moe_runner_backend"] if moe else None,
        }
        for i, (node, local) in enumerate(engine_placement(cfg))
    ]  # fmt: skip
    memory = memory_json(cfg)
    return {
        "recipe": cfg.recipe,
        "algorithm": cfg.algo.name.value,
        "run_dir": str(run_dir),
        "slurm": slurm_header(cfg),
        # what the trainer sends and the engines must serve (their SGLang environment: quant.engine_env)
        "quant": {"name": cfg.quant.name.value, "engine_env": dict(cfg.quant.engine_env)},
        "nnodes": cfg.cluster.nnodes,
        "engine": {
            "kind": cfg.parallel.rollout.engine.value,
            # SGLang's interpreter (its own environment); the reference engine runs in this one
            "python": engine_python(cfg) if cfg.parallel.rollout.engine == RolloutEngineKind.sglang else None,
            "reproducible_sampling": cfg.engine.reproducible_sampling,
            "keys_file": str(engine_keys_file(run_dir)) if engines_need_keys(cfg) else None,
            "weight_sync_timeout_s": cfg.sync.timeout_s,
            # SGLang's --dtype and MoE path (the same for every engine of the run)
            "dtype": cfg.engine.dtype.value if sglang else None,
            "moe": moe,
            # why a failed push must end with fresh engines (post-processing not idempotent), or null
            "restart_on_failed_push": sglang_moe.restart_reason(cfg),
            "max_requeues": cfg.cluster.max_requeues,  # requeues after failed pushes, per run dir
            # a dead or hung engine restarted while the run goes on (0: it stops the run; colocated: 0)
            "max_restarts": restart_budget(cfg),
            "min_alive": cfg.engine.min_alive,
            "health_timeout_s": cfg.engine.health_timeout_s,
            # how a hung engine is found: its heartbeats (reference), or /health_generate probes (SGLang)
            "hang_detection": "health_generate" if sglang else "heartbeat",
            "engines": len(topology(cfg).engines),
            "colocated": cfg.parallel.colocate,
            "emulate_non_idempotent_postprocess": sglang_moe.emulates_non_idempotent(cfg),
        },
        "training": training_layout(cfg),
        "reward": reward_plan(cfg),
        "rollout": rollout_plan(cfg),
        # per GPU against cluster.device, and the time of a step (dsv4rl.estimate; none on CPU)
        "memory": memory,
        "step_time": step_time_json(cfg),
        "engines": engines,
        "nodes": [{**node_plan(cfg, run_dir, n), "memory": node_memory(memory, n)} for n in nodes],
        "warnings": list(warnings or []),
        "reference_run": reference_run_plan(cfg),
    }


JUDGE_STARTED_BY = (
    "you: an SGLang engine started for the judge (GPUs of its own, not the run's) or a hosted API; "
    "dsv4rl does not start it"
)


def reward_plan(cfg: Config) -> dict[str, Any]:
    """The reward's functions, the worker processes of the sync ones, and its external services."""
    r = cfg.reward
    remote, judge = r.remote, r.judge
    return {
        "functions": [
            {
                "name": fn.name,
                "target": fn.target,
                "weight": fn.weight,
                "group": fn.group,
                "on_error": str(fn.on_error),
            }
            for fn in effective_fns(r)
        ],  # fmt: skip
        "num_workers": r.num_workers,
        "remote": {
            "name": remote.name,
            "url": remote.url,
            "weight": remote.weight,
            "max_concurrency": remote.max_concurrency,
        }
        if remote.url
        else None,  # fmt: skip
        "judge": {
            "name": judge.name,
            "base_url": judge.base_url,
            "model": judge.model,
            "weight": judge.weight,
            "rpm": judge.rpm,
            "tpm": judge.tpm,
            "started_by": JUDGE_STARTED_BY,
        }
        if judge.base_url
        else None,  # fmt: skip
    }


def _tools_plan(cfg: Config) -> list[dict[str, Any]]:
    """Each tool of `rollout.tools`, built as the driver builds it: where its calls run and what isolates
    them on this node (the driver node measures again when the run starts and refuses less)."""
    from dsv4rl.config.compose import reward_base_dirs
    from dsv4rl.tools.loading import build_tool, tool_isolation

    r = cfg.rollout
    out = []
    for entry in r.tools:
        row = {"target": entry.target, "name": entry.name, "timeout_s": entry.timeout_s}
        if r.mode == RolloutMode.tools:
            row |= tool_isolation(build_tool(entry, reward_base_dirs(cfg)))
            if row.get("memory_mb"):  # every call in flight at once, on the driver node
                row["node_memory_mb"] = row["memory_mb"] * r.max_concurrent_tools
        out.append(row)
    return out


def rollout_plan(cfg: Config) -> dict[str, Any]:
    """How trajectories are generated: the mode, its tools or environment, the budgets (docs/agents.md)."""
    r = cfg.rollout
    return {
        "mode": r.mode.value,
        "tools": _tools_plan(cfg),
        "probed_on": socket.gethostname(),
        "env": r.env,
        "max_turns": r.max_turns,
        "max_tool_calls": r.max_tool_calls,
        "max_new_tokens_per_turn": r.max_new_tokens_per_turn or cfg.algo.sampling.max_new_tokens,
        "max_total_tokens": r.max_total_tokens,
        "max_concurrent_tools": r.max_concurrent_tools,
        "max_tool_error_fraction": r.max_tool_error_fraction,
        # how far behind the trained weights a batch may be sampled, and the size of a batch held for it
        **staleness_plan(cfg),
    }


def staleness_plan(cfg: Config) -> dict[str, Any]:
    """The loop the staleness bound K picks, and the samples the driver may hold for it beyond the batch
    training: K <= 1 holds K batches; the stream runs and keeps up to K + 1 batches of groups
    (`algo.oversample.factor` times as many running)."""
    bound = staleness_bound(cfg.algo)
    batch = cfg.algo.prompts_per_step * cfg.algo.group_size
    factor = cfg.algo.oversample.factor if bound >= 2 else 1.0
    held = bound * batch if bound <= 1 else math.ceil((bound + 1) * batch * factor)
    return {
        "max_staleness": bound,
        "loop": "synchronous" if bound == 0 else "one_step_off_policy" if bound == 1 else "fully_async",
        "batch_samples": batch,
        "held_samples": held,
        "pause_mode": cfg.sync.pause_mode.value if bound >= 2 else None,
    }


def _staleness_text(rollout: dict[str, Any]) -> str:
    bound, samples = rollout["max_staleness"], rollout["batch_samples"]
    if bound == 0:
        return "loop: synchronous (algo.max_staleness=0): each batch is sampled by the weights it trains"
    if bound == 1:
        return (
            f"loop: {bound} step(s) off-policy (algo.max_staleness={bound}): the next batch is generated "
            f"while this one trains; {bound} batch(es) of {samples} samples held on the driver's host; "
            "TIS/MIS correct for the staleness"
        )
    return (
        f"loop: fully asynchronous (algo.max_staleness={bound}): the engines generate throughout, each step "
        f"takes finished groups at most {bound} versions old (older ones are dropped); up to "
        f"{rollout['held_samples']} samples (batches of {samples}) in flight or waiting on the driver's "
        f"host; pushes pause generation (sync.pause_mode={rollout['pause_mode']}); "
        "TIS/MIS correct for the staleness"
    )


def _rollout_text(rollout: dict[str, Any]) -> str | None:
    if rollout["mode"] == "single_turn":
        return None
    what = (
        "tools "
        + ", ".join(f"{t['name'] or t['target']} ({t['timeout_s']:g} s a call)" for t in rollout["tools"])
        if rollout["mode"] == "tools"
        else f"environment {rollout['env']}"
    )
    lines = [
        f"rollout: {rollout['mode']} mode, {what}; a trajectory: at most {rollout['max_turns']} turn(s), "
        f"{rollout['max_tool_calls']} call(s), {rollout['max_total_tokens']} tokens "
        f"({rollout['max_new_tokens_per_turn']} a turn); {rollout['max_concurrent_tools']} calls in flight; "
        f"the run stops past {rollout['max_tool_error_fraction'] * 100:g}% failed calls of a tool in a step"
    ]
    for tool in rollout["tools"]:
        if "isolation" not in tool:
            continue
        name = tool["name"] or tool["target"]
        lines.append(f"  {name}: isolation {tool['isolation']} (as probed on {rollout['probed_on']})")
        for guarantee, layer in tool.get("layers", {}).items():
            lines.append(f"    {guarantee}: {layer}")
        if tool.get("memory_mb"):
            lines.append(f"    limits: {tool['memory_mb']} MB per call over all its processes, "
                         f"{tool['max_processes']} process(es); all calls in flight: "
                         f"{tool['node_memory_mb'] / 1024:.1f} GiB at most on the driver node")  # fmt: skip
        lines += [f"    note: {note}" for note in tool.get("notes", [])]
    return "\n".join(lines)


def _reward_text(reward: dict[str, Any]) -> str:
    lines = ["reward (weighted sum; weight 0: logged only):"]
    for fn in reward["functions"]:
        group = ", group" if fn["group"] else ""
        lines.append(f"  {fn['weight']:g} x {fn['name']} = {fn['target']} (on_error {fn['on_error']}{group})")
    if any(not f["target"].startswith("builtin:") for f in reward["functions"]):
        lines.append(f"  sync functions run in {reward['num_workers']} worker process(es) on node 0")
    if reward["remote"]:
        remote = reward["remote"]
        lines.append(f"  {remote['weight']:g} x {remote['name']} = remote service {remote['url']} (external)")
    if reward["judge"]:
        judge = reward["judge"]
        limits = f"rpm {judge['rpm'] or 'unlimited'}, tpm {judge['tpm'] or 'unlimited'}"
        where = f"judge {judge['model']} at {judge['base_url']}"
        lines.append(
            f"  {judge['weight']:g} x {judge['name']} = {where} ({limits}); started by {judge['started_by']}"
        )
    return "\n".join(lines)


def training_layout(cfg: Config) -> dict[str, Any]:
    t = cfg.parallel.train
    return {
        "backend": t.backend.value,
        "world_size": t.nnodes * t.nproc_per_node,
        "tensor_parallel": t.tensor_parallel,
        "pipeline_parallel": t.pipeline_parallel,
        "stage_layers": stage_layers(cfg),
        "expert_parallel": t.expert_parallel,
        "expert_tensor_parallel": t.expert_tensor_parallel,
        "data_parallel": data_parallel_size(cfg),
        "recompute": t.recompute.value,
        "optimizer_cpu_offload": t.optimizer_cpu_offload,
        "optimizer_offload_fraction": t.optimizer_offload_fraction if t.optimizer_cpu_offload else 0.0,
        # who broadcasts the weights: one source rank per pipeline stage, each with its own group and port
        "weight_sync_sources": [asdict(source) for source in weight_sync_sources(cfg)],
        # colocated (parallel.colocate): by tensor handles, the engines' memory released while training
        "weight_sync_transport": sync_transport(cfg).value,
    }


def _layout_text(layout: dict[str, Any]) -> str:
    stages = "+".join(str(n) for n in layout["stage_layers"])
    offload = (
        f"{layout['optimizer_offload_fraction']:.0%} of the optimizer on the CPU"
        if layout["optimizer_cpu_offload"]
        else "no optimizer offload"
    )
    senders = ", ".join(
        f"stage {s['stage']} from rank {s['rank']} at {s['address'] or '?'}:{s['port']} ({s['group_name']})"
        for s in layout["weight_sync_sources"]
    )
    if layout.get("weight_sync_transport") == SyncTransport.tensor:
        ranks = ", ".join(f"stage {s['stage']} from rank {s['rank']}" for s in layout["weight_sync_sources"])
        senders = (
            f"colocated, by tensor handles (/update_weights_from_tensor): {ranks}; the engines release "
            "their memory (weights, KV cache, CUDA graphs) while the trainer trains"
        )
    return (
        f"training: {layout['backend']} on {layout['world_size']} rank(s), TP{layout['tensor_parallel']}/"
        f"PP{layout['pipeline_parallel']}/EP{layout['expert_parallel']}/DP{layout['data_parallel']} "
        f"(layers per stage {stages}), recompute {layout['recompute']}, {offload}\n"
        f"weights to the engines: {senders}"
    )


def restarts_text(engine: dict) -> str:
    if engine["max_restarts"] == 0:
        why = " (colocated engines share the trainer's GPUs)" if engine["colocated"] else ""
        return f"engine restarts: off{why}; an engine failure stops the run"
    if engine["engines"] < 2:
        return "engine restarts: none with one engine (engine.min_alive=1); an engine failure stops the run"
    hung = (
        "a hung one is found by its heartbeats"
        if engine["hang_detection"] == "heartbeat"
        else f"hung: two /health_generate probes in a row unanswered within engine.health_timeout_s="
        f"{engine['health_timeout_s']:g} s while requests are open"
    )
    return (
        f"engine restarts: a dead or hung engine is restarted, at most {engine['max_restarts']} times, while "
        f"the others generate (engine.min_alive={engine['min_alive']}); it rejoins at the next sync; {hung}"
    )


def _moe_text(dtype: str, moe: dict[str, Any]) -> str:
    """One line on what every SGLang engine is given and will hold."""
    family = moe["device_family"] + (" with aiter" if moe["aiter"] else "")
    resolves = ""
    if moe["resolves_to"] is None:
        resolves = " (resolves on the GPU: device unknown)"
    elif moe["resolves_to"] != moe["moe_runner_backend"]:
        resolves = f" (resolves to {moe['resolves_to']})"
    scales = (
        f"experts {moe['experts']} with {moe['expert_scale_dtype'] or 'GPU-dependent'} scales, FP8 linears "
        f"with {moe['linear_scale_dtype']} block scales"
        if moe["linear_scale_dtype"]
        else f"experts {moe['experts']}"
    )
    repeat = {True: "yes", False: "no", None: "unknown"}[moe["idempotent"]]
    return (
        f"SGLang engines on {family}: --dtype {dtype}, --moe-runner-backend {moe['moe_runner_backend']}"
        f"{resolves}; they hold {scales}; post-processing idempotent: {repeat} ({moe['source']})"
    )


def _env_text(env: dict[str, str]) -> str:
    return "\n".join(f"{k}={v}" for k, v in env.items()) or "-"


def reference_run_plan(cfg: Config) -> dict[str, Any]:
    """Of the published run's settings dapo_math keeps (docs/reference_run.md): which this config keeps."""
    comparison = compare_with_reference(cfg)
    return {
        "kept": len(comparison.kept),
        "total": len(comparison.kept) + len(comparison.changed),
        "changed": [
            {"key": row.key, "reference": row.expected, "value": value} for row, value in comparison.changed
        ],
        "line": comparison.line(),
    }


def render_plan(plan: dict[str, Any], console: Console) -> None:
    """One panel per node: a process table and the environment each process gets."""
    console.print(
        Text(
            f"recipe {plan['recipe']} ({plan['algorithm']}): {plan['nnodes']} node(s), "
            f"run dir {plan['run_dir']}",
            style="bold",
        )
    )
    if plan["slurm"]:
        console.print("Slurm batch script header (cluster.*):\n  " + "\n  ".join(plan["slurm"]))
    console.print(f"weights on the wire: quant={plan['quant']['name']} (the engines must serve that format)")
    engine = plan["engine"]
    if engine["python"]:
        console.print(f"SGLang interpreter (engine.python): {engine['python']}")
    sampling = (
        "reproducible (one seeded request per sample, --enable-deterministic-inference)"
        if engine["reproducible_sampling"]
        else "not reproducible on SGLang (no seed sent; engine.reproducible_sampling=true to seed)"
    )
    console.print(f"sampling: {sampling}")
    if engine["moe"]:
        console.print(_moe_text(engine["dtype"], engine["moe"]), soft_wrap=True)
    console.print(restarts_text(engine), soft_wrap=True)
    if engine["restart_on_failed_push"]:
        requeue = (
            f"exit {FAILED_PUSH_EXIT} and <run.dir>/FAILED_PUSH, then resume=auto starts new ones (the "
            f"sbatch script requeues the job, at most cluster.max_requeues={engine['max_requeues']} times)"
        )
        restarts = (
            "the trainer asks for them to be restarted and pushes again; where refused, "
            if engine["max_restarts"] > 0
            else ""
        )
        console.print(
            f"a failed weight push spends the engines: {engine['restart_on_failed_push']}; they must be "
            f"restarted: {restarts}{requeue}",
            soft_wrap=True,
        )
    if engine["keys_file"]:
        console.print(
            f"engine api and admin keys: {engine['keys_file']} (mode 0600; ${ADMIN_KEY_ENV} chooses the "
            "admin key, else random per run)"
        )
    console.print(
        f"weight-update group timeout: {engine['weight_sync_timeout_s']:g} s on trainer and engines"
    )
    console.print(_layout_text(plan["training"]))
    console.print(_reward_text(plan["reward"]), soft_wrap=True, highlight=False)
    console.print(_staleness_text(plan["rollout"]), soft_wrap=True, highlight=False)
    rollout = _rollout_text(plan["rollout"])
    if rollout:
        console.print(rollout, soft_wrap=True, highlight=False)
    render_memory(plan["memory"], console)
    render_step_time(plan["step_time"], console)
    for node in plan["nodes"]:
        table = Table(show_lines=True, expand=False)
        for column in ("process", "role", "gpus", "port", "command"):
            table.add_column(column, overflow="fold")
        for p in node["processes"]:
            port = "-" if p["port"] is None else str(p["port"])
            table.add_row(p["name"], p["role"], p["gpus"] or "-", port, shlex.join(p["argv"]))
        procs = node["processes"]
        common = {k: v for k, v in procs[0]["env"].items() if all(q["env"].get(k) == v for q in procs)}
        env = Table.grid(padding=(0, 2))
        env.add_column(style="cyan")
        env.add_column(overflow="fold")
        env.add_row("env (all)", _env_text(common))
        for p in procs:
            extra = {k: v for k, v in p["env"].items() if k not in common}
            if extra:
                env.add_row(f"env ({p['name']})", _env_text(extra))
        if node["waits_for"] is None:
            env.add_row(
                "waits for", Text("engines on other nodes: unresolved (set cluster.node_addrs)", "yellow")
            )
        elif node["waits_for"]:
            env.add_row("waits for", "\n".join(f"{w['name']} {w['health_url']}" for w in node["waits_for"]))
        env.add_row("listens", ", ".join(f"{p['port']} ({p['what']})" for p in node["listens"]) or "-")
        if node["memory"]:
            env.add_row("memory", node_memory_text(node["memory"]))
        address = f" ({node['address']})" if node["address"] else ""
        title = f"node {node['node']}{address}: {', '.join(node['roles'])}"
        console.print(Panel(Group(table, env), title=title, title_align="left", expand=False))
    for warning in plan["warnings"]:
        console.print(Text(f"warning: {warning}", style="yellow"), soft_wrap=True)
    console.print(plan["reference_run"]["line"], soft_wrap=True, highlight=False)
