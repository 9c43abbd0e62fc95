"""The GPU check's one JSON summary (launch/gpu_check.sh): which checks run for how many GPUs, the summary
built from their result files, and its JSON schema. Standard library only: it runs with any python3.

    gpu_check_summary.py checks GPUS FORMATS...            the checks for GPUS GPUs, one `name path` a line
    gpu_check_summary.py summary OUT --gpus N ... --formats F...  the summary of a run whose files are in OUT
    gpu_check_summary.py dry-run OUT ... --formats F...           the checks for 1 and 2+ GPUs, the schema

Result files, written by gpu_check.sh: `trainer/trainer.json`, `trainer.rc`, `trainer.log` (the trainer
check); `<check>.json` (`dsv4rl align --json`), `<check>.rc`, `<check>.log` per push check; in a dry run
`dry-run/<check>.plan.json` (`dsv4rl plan --json`), `.rc`, `.log`, `.argv`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VERSION = 1
TRAINER = "trainer"
TRAINER_COMMAND = "python -m torch.distributed.run --nproc-per-node 1 launch/gpu_check_trainer.py OUT/trainer"
PATHS = {
    TRAINER: (
        0,
        "the megatron backend on GPU 0 (on the CPU without one): bf16 log-probs against transformers' fp32 "
        "model, the distributed optimizer with CPU offload, its checkpoint saved and loaded, a NaN step "
        "skipped",
    ),
    "colocated_push": (
        1,
        "colocated: the trainer and one SGLang engine share GPU 0; the engine releases its memory while the "
        "trainer works and takes the weights by CUDA/HIP IPC tensor handles (/update_weights_from_tensor)",
    ),
    "broadcast_push": (
        2,
        "disaggregated: the SGLang engine on GPU 0, the trainer on GPU 1; the weights are broadcast over an "
        "NCCL/RCCL process group (/init_weights_update_group, /update_weights_from_distributed)",
    ),
}
FORMAT_NOTES = {
    "fp8_rollout": "the reference recipe's format: the engine's checkpoint holds MXFP4 experts, as the "
    "release does, de-quantized to FP8 at load (SGLANG_DSV4_FP4_DEQUANT=1), and the trainer sends FP8",
    "bf16": "a bf16 checkpoint and push: tells a kernel problem from a quantization one",
}
FIGURES = {  # summary key -> (align report keys); push checks only
    "push_s": ("sync", "seconds"),
    "push_bytes": ("sync", "bytes"),
    "push_tensors": ("sync", "tensors"),
    "push_buckets": ("sync", "buckets"),
    "transport": ("sync", "transport"),
    "logprob_mean_abs_diff": ("mean_abs_diff",),
    "logprob_p99_abs_diff": ("p99_abs_diff",),
    "logprob_max_abs_diff": ("max_abs_diff",),
    "tokens": ("tokens",),
}
_NUMBER = {"type": ["number", "null"]}
SUMMARY_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "dsv4rl GPU check summary (launch/gpu_check.sh)",
    "type": "object",
    "required": ["tool", "version", "gpus", "device", "cluster_device", "comm", "shape", "formats", "ok",
                 "checks", "skipped"],
    "properties": {
        "tool": {"const": "dsv4rl gpu_check"},
        "version": {"const": VERSION},
        "gpus": {"type": "integer", "description": "GPUs visible (GPUS overrides)"},
        "device": {"type": "string", "description": "GPU 0's name as torch reports it, or 'cpu'"},
        "cluster_device": {"type": "string", "description": "cluster.device the checks ran with"},
        "comm": {"type": "string", "description": "the comm preset (nccl_h100, rccl_mi355x)"},
        "shape": {"enum": ["tiny", "kernel"]},
        "formats": {"type": "array", "items": {"type": "string"}},
        "ok": {"type": "boolean", "description": "every check that ran passed"},
        "checks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "path", "gpus_needed", "ok", "exit_code", "figures", "error"],
                "properties": {
                    "name": {"type": "string", "description": "trainer, colocated_push.<format>, "
                             "broadcast_push.<format>"},
                    "path": {"type": "string", "description": "what runs, in words"},
                    "gpus_needed": {"type": "integer"},
                    "format": {"type": "string", "description": "push checks: the weight format (quant)"},
                    "ok": {"type": "boolean"},
                    "exit_code": {"type": "integer"},
                    "figures": {
                        "type": ["object", "null"],
                        "description": "trainer: its report (bf16_parity, offload_optimizer, "
                        "checkpoint_resume, nonfinite_skip); push checks: the keys below",
                        "properties": {
                            **{key: _NUMBER for key in FIGURES if key != "transport"},
                            "transport": {"enum": ["tensor", "broadcast", None]},
                        },
                    },
                    "error": {"type": ["array", "null"], "items": {"type": "string"},
                              "description": "the last lines of its log when it failed"},
                },
            },
        },
        "skipped": {
            "type": "array",
            "items": {"type": "object", "required": ["name", "why"],
                      "properties": {"name": {"type": "string"}, "why": {"type": "string"}}},
        },
    },
}  # fmt: skip


def kind(name: str) -> str:
    return name.split(".", 1)[0]


def planned(gpus: int, formats: list[str]) -> list[str]:
    """The checks for `gpus` GPUs: the trainer always, each push path the GPUs allow, once per format."""
    names = [TRAINER]
    for path in ("colocated_push", "broadcast_push"):
        if gpus >= PATHS[path][0]:
            names += [f"{path}.{fmt}" for fmt in formats]
    return names


def describe(name: str) -> dict:
    gpus_needed, path = PATHS[kind(name)]
    entry = {"name": name, "path": path, "gpus_needed": gpus_needed}
    if name != TRAINER:
        fmt = name.split(".", 1)[1]
        entry["format"] = fmt
        entry["path"] += f"; {fmt}: {FORMAT_NOTES.get(fmt, 'quant=' + fmt)}"
    return entry


def _tail(path: Path, lines: int = 20) -> list[str]:
    try:
        return path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return [f"{path} is missing"]


def _rc(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return -1


def _dig(report: dict, keys: tuple[str, ...]) -> object:
    for key in keys:
        report = report.get(key) if isinstance(report, dict) else None
    return report


def result(out: Path, name: str) -> dict:
    """One check's entry from its files."""
    entry = describe(name)
    if name == TRAINER:
        rc = _rc(out / "trainer.rc")
        report_path = out / "trainer" / "trainer.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        ok = rc == 0 and bool(report and report.get("ok"))
        error = None if ok else _tail(out / "trainer.log")
        entry.update(ok=ok, exit_code=rc, figures=report, error=error)
        return entry
    rc = _rc(out / f"{name}.rc")
    figures, error = None, None
    if rc == 0:
        report = json.loads((out / f"{name}.json").read_text())
        figures = {key: _dig(report, keys) for key, keys in FIGURES.items()}
    else:
        error = _tail(out / f"{name}.log")
    entry.update(ok=rc == 0, exit_code=rc, figures=figures, error=error)
    return entry


def summary(out: Path, args: argparse.Namespace) -> dict:
    checks, skipped = [], []
    for name in planned(args.gpus, args.formats):
        if name != TRAINER and not args.engines:
            why = f"no SGLang interpreter at {args.sglang} (make install-sglang)"
            skipped.append({"name": name, "why": why})
            continue
        checks.append(result(out, name))
    for name in planned(2, args.formats):
        if name not in planned(args.gpus, args.formats):
            need = PATHS[kind(name)][0]
            skipped.append({"name": name, "why": f"needs {need} GPU(s), {args.gpus} visible"})
    return {
        "tool": "dsv4rl gpu_check", "version": VERSION, "gpus": args.gpus, "device": args.device,
        "cluster_device": args.cluster_device, "comm": args.comm, "shape": args.shape,
        "formats": args.formats, "ok": all(c["ok"] for c in checks), "checks": checks, "skipped": skipped,
    }  # fmt: skip


def dry_run(out: Path, args: argparse.Namespace) -> dict:
    """The checks for 1 and for 2+ GPUs, each push check with the command it runs and what `dsv4rl plan`
    made of it (the engine's argv and environment), and the summary's schema."""
    lists = {}
    for gpus, label in ((1, "1"), (2, "2+")):
        entries = []
        for name in planned(gpus, args.formats):
            entry = describe(name)
            folder = out / "dry-run"
            if name == TRAINER:
                entry["command"] = TRAINER_COMMAND
            else:
                overrides = (folder / f"{name}.argv").read_text().splitlines()
                entry["command"] = ["dsv4rl", "align", *overrides, "--json"]
                rc = _rc(folder / f"{name}.rc")
                entry["plan_ok"] = rc == 0
                if rc == 0:
                    plan = json.loads((folder / f"{name}.plan.json").read_text())
                    processes = plan["nodes"][0]["processes"]
                    engine = next(p for p in processes if p["role"] == "engine")
                    trainer = next(p for p in processes if p["role"] == "trainer")
                    entry["engine_argv"] = engine["argv"]
                    entry["engine_env"] = plan["quant"]["engine_env"]
                    entry["engine_gpus"], entry["trainer_gpus"] = engine.get("gpus"), trainer.get("gpus")
                    entry["transport"] = plan["training"]["weight_sync_transport"]
                    entry["warnings"] = plan["warnings"]
                else:
                    entry["error"] = _tail(folder / f"{name}.log")
            entries.append(entry)
        lists[label] = entries
    return {
        "tool": "dsv4rl gpu_check", "version": VERSION, "dry_run": True,
        "cluster_device": args.cluster_device, "comm": args.comm, "shape": args.shape,
        "formats": args.formats, "checks": lists, "summary_schema": SUMMARY_SCHEMA,
    }  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    checks = sub.add_parser("checks")
    checks.add_argument("gpus", type=int)
    checks.add_argument("formats", nargs="*")
    full = sub.add_parser("summary")
    full.add_argument("out", type=Path)
    for flag in ("--device", "--cluster-device", "--comm", "--shape", "--sglang"):
        full.add_argument(flag, required=True)
    full.add_argument("--gpus", type=int, required=True)
    full.add_argument("--engines", type=int, choices=(0, 1), required=True)
    full.add_argument("--formats", nargs="*", default=[])
    dry = sub.add_parser("dry-run")
    dry.add_argument("out", type=Path)
    for flag in ("--cluster-device", "--comm", "--shape"):
        dry.add_argument(flag, required=True)
    dry.add_argument("--formats", nargs="*", default=[])
    args = parser.parse_args(argv)
    if args.mode == "checks":
        print("\n".join(planned(args.gpus, args.formats)))
        return 0
    if args.mode == "dry-run":
        print(json.dumps(dry_run(args.out, args), indent=2))
        return 0
    report = summary(args.out, args)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
