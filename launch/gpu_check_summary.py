"""The GPU check's one JSON summary (launch/gpu_check.sh): which checks run for how many GPUs, the summary
built from their result files, and its JSON schema. Standard library only: it runs with any python3.

    gpu_check_summary.py checks GPUS FORMATS...            the checks for GPUS GPUs, one `name path` a line
    gpu_check_summary.py summary OUT --gpus N ... --formats F...  the summary of a run whose files are in OUT
    gpu_check_summary.py dry-run OUT ... --formats F...           the checks for 1 and 2+ GPUs, the schema

Result files, written by gpu_check.sh: `trainer/trainer.json`, `trainer.rc`, `trainer.log` (the trainer
check); `<check>.json` (`dsv4rl align --json`), `<check>.rc`, `<check>.log` per push check; in a dry run
`dry-run/<check>.plan.json` (`dsv4rl plan --json`), `.rc`, `.log`, `.argv`.

A check passes on its measurements, never on an exit code alone: the trainer on its report's own checks,
a push on align's mean and max |trainer - engine| log-prob under its format's bounds (LOGPROB_BOUNDS). A
push whose report is missing or lacks a figure is "not measured", which fails the summary too. stdout gets
the JSON; stderr a line per check, the figures beside their bounds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VERSION = 2  # 2: each check's status and bounds
TRAINER = "trainer"
TRAINER_CHECKS = ("bf16_parity", "offload_optimizer", "checkpoint_resume", "nonfinite_skip")  # its report's
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
# The bounds a push check's |trainer - engine| log-prob (nats, over align's sampled tokens) must stay under,
# per weight format (quant). No GPU has measured them yet; they are set from what `dsv4rl align` measured on
# the CPU: the format alone (reference engine in fp32; docs/weights.md: mean 3.8e-4, max 1.2e-3 for bf16,
# 4.9e-3 and 1.5e-2 for FP8) and with SGLang 0.5.23's rounding points emulated (docs/numerics.md, "Measured
# on CPU": mean 3.3e-3, max 0.10 unquantized; 1.1e-2 and 0.13 FP8). Means of about 10x the emulated ones
# and a max of 4-5x its worst token leave room for what the emulation lacks (the indexer's FP8, GEMM orders,
# FlashMLA's bf16 probabilities) and the kernel shapes. The tiny model's log-probs are nearly uniform, so a
# wrong push moves them less than it would a trained model's; the bounds are tight enough for the smallest
# wrong push measured there, the lm_head shifted by one row (mean 0.17, max 0.6), while a corrupted bucket
# gives NaN (tests/launcher/test_gpu_check_bounds.py). `none` and `bf16` share a bound: SGLang computes in
# bf16 whatever it is sent. Recalibrate from the first GPU runs' summaries.
LOGPROB_BOUNDS: dict[str, dict[str, float]] = {
    "none": {"logprob_mean_abs_diff": 0.03, "logprob_max_abs_diff": 0.5},
    "bf16": {"logprob_mean_abs_diff": 0.03, "logprob_max_abs_diff": 0.5},
    "fp8_rollout": {"logprob_mean_abs_diff": 0.1, "logprob_max_abs_diff": 0.5},
    "fp8_mxfp4": {"logprob_mean_abs_diff": 0.1, "logprob_max_abs_diff": 0.5},
}
PASSED, FAILED, NOT_MEASURED = "passed", "failed", "not measured"
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
        "ok": {"type": "boolean", "description": "every check that ran passed on its measurements"},
        "checks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "path", "gpus_needed", "ok", "status", "exit_code", "figures",
                             "bounds", "error"],
                "properties": {
                    "name": {"type": "string", "description": "trainer, colocated_push.<format>, "
                             "broadcast_push.<format>"},
                    "path": {"type": "string", "description": "what runs, in words"},
                    "gpus_needed": {"type": "integer"},
                    "format": {"type": "string", "description": "push checks: the weight format (quant)"},
                    "ok": {"type": "boolean", "description": "status is passed"},
                    "status": {"enum": [PASSED, FAILED, NOT_MEASURED],
                               "description": "not measured: exited 0 without the figures it is judged on"},
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
                    "bounds": {
                        "type": ["object", "null"],
                        "description": "push checks: the figures' upper bounds for the format "
                        "(LOGPROB_BOUNDS); the trainer's bounds are in its report",
                        "properties": {key: {"type": "number"} for key in LOGPROB_BOUNDS["bf16"]},
                    },
                    "error": {"type": ["array", "null"], "items": {"type": "string"},
                              "description": "why it did not pass: the figures over their bounds or "
                              "missing, then the last lines of its log"},
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
    entry = {"name": name, "path": path, "gpus_needed": gpus_needed, "bounds": None}
    if name != TRAINER:
        fmt = name.split(".", 1)[1]
        entry["format"] = fmt
        entry["path"] += f"; {fmt}: {FORMAT_NOTES.get(fmt, 'quant=' + fmt)}"
        entry["bounds"] = LOGPROB_BOUNDS.get(fmt)
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


def _report(path: Path) -> tuple[dict | None, str | None]:
    """The JSON object in `path`, or None and why not."""
    try:
        report = json.loads(path.read_text())
    except OSError:
        return None, f"{path} is missing"
    except ValueError as exc:
        return None, f"{path} is not JSON ({exc})"
    if not isinstance(report, dict):
        return None, f"{path} holds no JSON object"
    return report, None


def judge(figures: dict, bounds: dict[str, float] | None, fmt: str) -> tuple[str, list[str]]:
    """A push's status from its figures: passed only when every bounded figure is a number under its
    bound over at least one token; a figure that is absent is not measured (never passed)."""
    if bounds is None:
        return NOT_MEASURED, [f"no log-prob bounds for quant={fmt} (LOGPROB_BOUNDS in {Path(__file__).name})"]
    missing, over = [], []
    tokens = figures.get("tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        missing.append(f"align's report compares no tokens (tokens: {tokens!r})")
    for key, bound in bounds.items():
        value = figures.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            missing.append(f"{key} is not in align's report ({'.'.join(FIGURES[key])}: {value!r})")
        elif not value <= bound:  # NaN is over too
            over.append(f"{key} {value:.4g} is over its bound {bound:g}")
    if missing:
        return NOT_MEASURED, missing + over
    return (FAILED, over) if over else (PASSED, [])


def result(out: Path, name: str) -> dict:
    """One check's entry from its files."""
    entry = describe(name)
    if name == TRAINER:
        rc = _rc(out / "trainer.rc")
        report, why = _report(out / "trainer" / "trainer.json")
        problems = [] if rc == 0 else [f"gpu_check_trainer.py exited {rc}"]
        if report is None:
            status = NOT_MEASURED if rc == 0 else FAILED
            problems.append(why)
        else:  # each of its checks says ok beside its figures and bounds
            absent = [key for key in TRAINER_CHECKS if not isinstance(report.get(key), dict)]
            failed = [k for k in TRAINER_CHECKS if k not in absent and report[k].get("ok") is not True]
            problems += [f"{key} is not in its report" for key in absent]
            problems += [f"{key} not ok" for key in failed]
            status = NOT_MEASURED if rc == 0 and absent and not failed else FAILED if problems else PASSED
        error = None if status == PASSED else problems + _tail(out / "trainer.log")
        return _entry(entry, status, rc, report, error)
    rc = _rc(out / f"{name}.rc")
    figures = None
    if rc != 0:
        status, problems = FAILED, [f"dsv4rl align exited {rc}"]
    else:
        report, why = _report(out / f"{name}.json")
        if report is None:
            status, problems = NOT_MEASURED, [f"dsv4rl align exited 0 but {why}"]
        else:
            figures = {key: _dig(report, keys) for key, keys in FIGURES.items()}
            status, problems = judge(figures, entry["bounds"], entry["format"])
    error = None
    if status != PASSED:  # over a bound: the figures say it all; otherwise the log says why
        bounded = status == FAILED and figures is not None
        error = problems if bounded else [*problems, *_tail(out / f"{name}.log")]
    return _entry(entry, status, rc, figures, error)


def _entry(entry: dict, status: str, rc: int, figures: dict | None, error: list[str] | None) -> dict:
    bounds = entry.pop("bounds")  # beside the figures
    ok = status == PASSED
    entry.update(ok=ok, status=status, exit_code=rc, figures=figures, bounds=bounds, error=error)
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


def render(report: dict) -> str:
    """The summary in lines for a reader: each check's status, a push's figures beside their bounds."""
    checks = report["checks"]
    passed = sum(c["ok"] for c in checks)
    verdict = "ok" if report["ok"] else "FAILED"
    skipped = len(report["skipped"])
    lines = [f"gpu check: {verdict}: {passed} of {len(checks)} checks passed, {skipped} skipped"]
    width = max(len(c["name"]) for c in [*checks, *report["skipped"]])
    for check in checks:
        line = f"  {check['name']:<{width}}  {check['status']}"
        figures, bounds = check["figures"] or {}, check["bounds"] or {}
        shown = [
            f"{_label(key)} {_number(figures.get(key))} (bound {bound:g})" for key, bound in bounds.items()
        ]
        if shown:  # mean 0.0041 (bound 0.1), max 0.05 (bound 0.5)
            line += "  |trainer - engine| log-prob: " + ", ".join(shown)
        lines.append(line)
        if not check["ok"]:
            lines += [f"    {problem}" for problem in (check["error"] or [])[:3]]
    lines += [f"  {s['name']:<{width}}  skipped: {s['why']}" for s in report["skipped"]]
    return "\n".join(lines)


def _label(key: str) -> str:
    return key.removeprefix("logprob_").removesuffix("_abs_diff")  # mean, max


def _number(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "missing"


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
        "formats": args.formats, "checks": lists, "logprob_bounds": LOGPROB_BOUNDS,
        "summary_schema": SUMMARY_SCHEMA,
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
    print(render(report), file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
