"""`dsv4rl plan`'s memory plan and step-time estimate: as JSON-able data and as rich text.

The numbers come from `dsv4rl.estimate` (pure arithmetic on the recipe); this module places each kind of
GPU on its nodes and prints the assumptions next to the figures.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dsv4rl.config.schema import Config
from dsv4rl.estimate.devices import device_spec
from dsv4rl.estimate.memory import TRAIN_OVERHEAD_GB, GpuMemory, GpuRole, memory_plan
from dsv4rl.estimate.step_time import step_time
from dsv4rl.topology import engine_nodes, engines_on_node

DIGITS = 2


def _round(values: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, DIGITS) if isinstance(v, float) else v for k, v in values.items()}


def _gpu_nodes(cfg: Config, gpu: GpuMemory) -> list[int]:
    if gpu.role == GpuRole.rollout:
        return [n for n in engine_nodes(cfg) if engines_on_node(cfg, n)]
    first, last = gpu.ranks or (0, 0)
    per_node = max(1, cfg.parallel.train.nproc_per_node)
    return sorted({rank // per_node for rank in range(first, last + 1)})


def _gpu_json(cfg: Config, gpu: GpuMemory) -> dict[str, Any]:
    data = asdict(gpu)
    data.pop("device_gb")
    data.update(
        role=gpu.role.value,
        ranks=list(gpu.ranks) if gpu.ranks else None,
        nodes=_gpu_nodes(cfg, gpu),
        components_gb=_round(gpu.components_gb),
        total_gb=round(gpu.total_gb, DIGITS),
        details=_round(gpu.details),
        fixes=list(gpu.fixes),
    )
    return data


def memory_json(cfg: Config) -> dict[str, Any]:
    """The run's memory plan: every kind of GPU with its components in GB, the device's GB, fits."""
    plan = memory_plan(cfg)
    spec = device_spec(cfg)
    return {
        "device": plan.device,
        "device_name": spec.name if spec else None,
        "device_gb": plan.device_gb,
        "checked": plan.skipped is None,
        "skipped": plan.skipped,
        "fits": plan.fits if plan.skipped is None else None,
        "forced": plan.forced,
        "overhead_gb": TRAIN_OVERHEAD_GB,
        "gpus": [_gpu_json(cfg, gpu) for gpu in plan.gpus],
    }


def node_memory(memory: dict[str, Any], node: int) -> dict[str, Any] | None:
    """The GPUs of `node` from the run's memory plan; None when nothing was estimated."""
    if not memory["checked"]:
        return None
    gpus = [g for g in memory["gpus"] if node in g["nodes"]]
    return {
        "device_gb": memory["device_gb"],
        "per_gpu": gpus,
        "peak_gb": max((g["total_gb"] for g in gpus), default=0.0),
        "fits": all(g["fits"] for g in gpus),
    }


def step_time_json(cfg: Config) -> dict[str, Any]:
    estimate = step_time(cfg)
    if estimate is None:
        reason = "not estimated on CPU (cluster.device=cpu)" if device_spec(cfg) is None else None
        return {"estimated": False, "reason": reason or "not estimated: model facts missing (model.*)"}
    data = _round(estimate.to_json())
    data["assumptions"] = _round(data["assumptions"])
    return {"estimated": True, **data}


# ------------------------------------------------------------------------------------------- text
def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render_memory(memory: dict[str, Any], console: Console) -> None:
    if not memory["checked"]:
        console.print(f"memory per GPU: {memory['skipped']}")
        return
    verdict = (
        "fits" if memory["fits"] else "DOES NOT FIT" + (" (forced: run.force_memory_plan)" * memory["forced"])
    )
    device = f"{memory['device_name']} ({memory['device_gb']:.0f} GB)"
    style = "bold" if memory["fits"] else "bold red"
    console.print(Text(f"memory per GPU, estimated against {device}: {verdict}", style=style))
    columns: list[str] = []
    for gpu in memory["gpus"]:
        columns += [c for c in gpu["components_gb"] if c not in columns]
    table = Table(expand=False)
    for name in ["GPU", "nodes", *(c.replace("_", " ") for c in columns), "total GB", "fits"]:
        table.add_column(name, justify="left" if name in ("GPU", "nodes") else "right")
    for gpu in memory["gpus"]:
        cells = [_gb(gpu["components_gb"].get(c)) for c in columns]
        fits = Text("yes", "green") if gpu["fits"] else Text("no", "red")
        nodes = ",".join(map(str, gpu["nodes"]))
        table.add_row(gpu["label"], nodes, *cells, _gb(gpu["total_gb"]), fits)
    console.print(table)
    for gpu in memory["gpus"]:
        d = gpu["details"]
        if "optimizer_on_cpu_gb" in d:
            console.print(
                f"  {gpu['label']}: {d['params_b']:.2f} B parameters, optimizer "
                f"{d['optimizer_on_cpu_gb']:.1f} GB on the CPU, recompute {d['recompute']}, "
                f"{d['micro_batches_in_flight']} micro batch(es) of {d['tokens_per_micro_batch']} tokens "
                "in flight"
            )
        elif "static_gb" in d:
            console.print(
                f"  {gpu['label']}: static budget {d['static_fraction']:g} x {memory['device_gb']:.0f} GB = "
                f"{d['static_gb']:.1f} GB (weights, then KV cache), headroom {d.get('headroom_gb', 0):.1f} GB"
            )
    console.print(
        f"  counted: weights in model.dtype over TP (experts over EP), fp32 gradients, fp32 main weights and "
        f"Adam moments over DP (minus the CPU-offloaded share), activations by recompute mode, "
        f"{memory['overhead_gb']:g} GB overhead; engines: weights in the quant format, KV cache = the rest "
        "of mem_fraction_static x device"
    )


def render_step_time(estimate: dict[str, Any], console: Console) -> None:
    if not estimate["estimated"]:
        console.print(f"step time: {estimate['reason']}")
        return
    a = estimate["assumptions"]
    overlap = "async, one step off-policy" if a["async_overlap"] else "colocated: no overlap"
    e = estimate
    parts = f"rollout {e['rollout_s']:.1f} s + train {e['train_s']:.1f} s + sync {e['sync_s']:.1f} s"
    console.print(
        Text(
            f"step time (estimate): {parts} = {e['step_s']:.1f} s; {overlap}: {e['step_async_s']:.1f} s",
            style="bold",
        )
    )
    console.print(
        f"  rollout: {e['generated_tokens']:,.0f} tokens (mean response {a['mean_response_tokens']:.0f} = "
        f"estimate.response_len_fraction {a['response_len_fraction']:g} of max_new_tokens) over "
        f"{a['engines']} engine(s) x estimate.engine_tokens_per_s {a['engine_tokens_per_s']:g}\n"
        f"  train: {e['trained_tokens']:,.0f} tokens (with estimate.mean_prompt_tokens "
        f"{a['mean_prompt_tokens']:g} a sample) x {a['active_params_b']:g} B active x "
        f"{e['flops_per_token_param']} FLOP = {e['train_flops']:.3g} FLOP over {a['train_gpus']} GPUs x "
        f"{a['peak_bf16_tflops']:g} TFLOP/s x estimate.mfu {a['mfu']:g}\n"
        f"  sync: {estimate['sync_bytes'] / 1e9:.1f} GB (quant={a['quant']}) at {a['sync_gb_per_s']:g} GB/s "
        f"{a['sync_link']}"
    )


def node_memory_text(memory: dict[str, Any]) -> Text:
    """One line for a node's panel: each kind of GPU it runs, its total against the device."""
    parts = ", ".join(f"{g['label']} {g['total_gb']:.1f} GB" for g in memory["per_gpu"])
    text = f"per GPU: {parts} of {memory['device_gb']:.0f} GB"
    return Text(text) if memory["fits"] else Text(text + " (does not fit)", "red")
