"""dsv4rl against TRL's GRPOTrainer on tiny_arith, in one sitting: wall time, step time, learning speed.

    python bench/vs_trl.py --trl-python /path/to/trl-venv/bin/python [--steps 120] [--no-async]
                           [--override KEY=VALUE ...] [--out bench/results/vs_trl.json]

TRL is not a dsv4rl dependency (it pins its own accelerate and datasets); give the interpreter of an
environment that has it:

    python -m venv trl-venv && trl-venv/bin/pip install torch==2.13.0 transformers==5.23.0 trl==1.16.0

The same task, model, batch and hyper-parameters on both sides: the tiny DeepSeek-V4 weights dsv4rl
builds from the recipe (saved as a transformers directory for TRL), the prompts in the order dsv4rl's
seeded stream gives them, 32 prompts x 16 samples, one-token answers, the recipe's AdamW, learning rate,
cosine decay, clip range and gradient clip. TRL generates in its own process with `model.generate` and
has no entropy bonus (dsv4rl's recipe uses 0.02). Runs, one after the other on the same machine:
`bench/trl_grpo.py` under TRL's interpreter, then `dsv4rl train recipe=tiny_arith` as a user runs it
(eval, checkpoints and sync checks as the recipe ships them), then the same with
`algo.async_rollout=true algo.tis.enabled=true`. Each is timed from command to exit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ASYNC_OVERRIDES, ROOT, bench_main, install_signal_handlers, run_meta, train_tiny_arith

DEFAULT_OUT = ROOT / "bench" / "results" / "vs_trl.json"
TRL_INSTALL = (
    "python -m venv trl-venv && trl-venv/bin/pip install torch==2.13.0 transformers==5.23.0 trl==1.16.0"
)


def learning(rewards: list[float], threshold: float = 0.8) -> dict[str, Any]:
    """The first step whose 10-step mean reward reaches `threshold`, and the mean of the last 10."""
    ends = range(10, len(rewards) + 1)
    passed = next((end for end in ends if statistics.mean(rewards[end - 10 : end]) >= threshold), None)
    last10 = statistics.mean(rewards[-10:]) if rewards else None
    return {"passes_0.8_at_step": passed, "last10_reward": last10}


def write_setup(cfg: Any, steps: int, workdir: Path) -> Path:
    """The transformers model directory and the prompts and hyper-parameters TRL's run takes."""
    import torch

    from dsv4rl.data.stream import build_prompt_stream
    from dsv4rl.model.model_dir import materialize_model
    from dsv4rl.model.native_checkpoint import load_native_model
    from dsv4rl.model.tokenizer import load_tokenizer

    native = materialize_model(cfg.model, str(workdir / "native"))
    hf_dir = workdir / "hf"
    load_native_model(native, dtype=torch.float32).save_pretrained(hf_dir)
    load_tokenizer(cfg.model).save_pretrained(hf_dir)
    stream = build_prompt_stream(cfg)
    prompts = [
        {"prompt": problem.prompt, "answer": problem.answer}
        for _ in range(steps)
        for problem in stream.next_batch()
    ]
    algo, optim = cfg.algo, cfg.optim
    setup = {
        "model": str(hf_dir),
        "output_dir": str(workdir / "trl-out"),
        "seed": int(cfg.seed),
        "prompts": prompts,
        "hyper": {
            "steps": steps,
            "prompts_per_step": algo.prompts_per_step,
            "group_size": algo.group_size,
            "max_new_tokens": algo.sampling.max_new_tokens,
            "temperature": algo.sampling.temperature,
            "top_p": algo.sampling.top_p,
            "lr": optim.lr,
            "betas": list(optim.betas),
            "eps": optim.eps,
            "weight_decay": optim.weight_decay,
            "grad_clip": optim.grad_clip,
            "min_lr_ratio": optim.min_lr_ratio,
            "kl_coef": algo.kl_coef,
            "eps_clip_low": algo.eps_clip_low,
            "eps_clip_high": algo.eps_clip_high,
        },
    }
    path = workdir / "setup.json"
    path.write_text(json.dumps(setup))
    return path


def run_trl(trl_python: str, setup: Path, workdir: Path) -> dict[str, Any]:
    out = workdir / "trl.json"
    argv = [trl_python, str(ROOT / "bench" / "trl_grpo.py"), str(setup), str(out)]
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        output = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        raise RuntimeError(f"TRL's run failed ({proc.returncode}):\n{output}")
    result = json.loads(out.read_text())
    return {
        "wall_s": wall,
        "step_median_s": statistics.median(result["step_times_s"]),
        **learning(result["rewards"]),
        "steps": len(result["rewards"]),
        "torch_threads": result["torch_threads"],
        "versions": result["versions"],
    }


def run_dsv4rl(steps: int, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    wall, records = train_tiny_arith(steps, overrides, run_dir)
    return {
        "wall_s": wall,
        "step_median_s": statistics.median(r["time_step_s"] for r in records),
        **learning([r["reward_mean"] for r in records]),
        "steps": len(records),
        "overrides": overrides,
    }


def check_trl(trl_python: str) -> None:
    probe = subprocess.run([trl_python, "-c", "import trl, datasets"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SystemExit(
            f"--trl-python {trl_python}: cannot import trl there ({probe.stderr.strip().splitlines()[-1:]}); "
            f"make one: {TRL_INSTALL}"
        )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dsv4rl.config.compose import compose

    if not args.trl_python:
        raise SystemExit(
            f"--trl-python is required: the interpreter of an environment with TRL: {TRL_INSTALL}"
        )
    check_trl(args.trl_python)
    install_signal_handlers()
    start = time.perf_counter()
    steps = args.steps or (20 if args.quick else 120)
    cfg = compose("tiny_arith", [f"train.steps={steps}", *args.override])
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dsv4rl-vs-trl-") as tmp:
        workdir = Path(tmp)
        results["trl"] = run_trl(args.trl_python, write_setup(cfg, steps, workdir), workdir)
        results["dsv4rl"] = run_dsv4rl(steps, list(args.override), workdir / "sync")
        if not args.no_async:
            results["dsv4rl_async"] = run_dsv4rl(steps, [*ASYNC_OVERRIDES, *args.override], workdir / "async")
    trl_wall = results["trl"]["wall_s"]
    ratios = {f"{name}_wall_vs_trl": results[name]["wall_s"] / trl_wall for name in results if name != "trl"}
    meta = run_meta("vs_trl", "quick" if args.quick else "full", {"steps": steps})
    meta["wall_seconds"] = time.perf_counter() - start
    return {"meta": meta, **results, "ratios": ratios}


def print_report(result: dict[str, Any]) -> None:
    print(f"{'run':<14}{'wall s':>9}{'step s':>9}{'0.8 at':>8}{'last 10':>9}")
    for name in ("trl", "dsv4rl", "dsv4rl_async"):
        if name in result:
            row = result[name]
            print(f"{name:<14}{row['wall_s']:>9.1f}{row['step_median_s']:>9.3f}"
                  f"{row['passes_0.8_at_step'] or '-':>8}{row['last10_reward']:>9.3f}")  # fmt: skip
    print(json.dumps({"ratios": result["ratios"]}, indent=2))


def main(argv: list[str] | None = None) -> int:
    return bench_main(
        __doc__,
        DEFAULT_OUT,
        "20 steps of each run",
        run,
        print_report,
        sys.argv[1:] if argv is None else argv,
        extra_args=[
            (("--trl-python",), {"default": "", "help": "the interpreter of an environment with trl"}),
            (("--steps",), {"type": int, "default": 0, "help": "steps of every run (default 120)"}),
            (("--no-async",), {"action": "store_true", "help": "skip the async dsv4rl run"}),
            (("--override",), {"action": "append", "default": [], "help": "a recipe override (repeatable)"}),
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
