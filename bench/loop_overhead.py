"""The RL loop's step time against its floor, measured in one run.

    python bench/loop_overhead.py [--quick] [--steps N] [--out bench/results/loop_overhead.json]

The floor is what one tiny_arith step cannot do without, each part measured on the same model, batch and
threads the run gets; generate and train each in a fresh process, as the run's engine and trainer are:

- generate: the reference engine's `Generator` (what serves /generate) producing the step's batch
  (prompts_per_step x group_size seeded samples), called in-process: no HTTP, no client;
- train: one forward + backward + fused AdamW step of that batch through transformers' model and the
  shared loss (`dsv4rl.algo.loss.micro_batch_loss`), without the loop around it;
- broadcast: the model's bytes, as one buffer, broadcast over a gloo group to a peer process (the sync
  sends one flattened buffer per bucket, and tiny_arith has one bucket).

Then `dsv4rl train recipe=tiny_arith` runs for `--steps` steps as a user runs it, and again with one-step-
off-policy async rollouts (unless --no-async); each metrics.jsonl gives each phase's mean over the steps
after the first two. Each floor is the median of its repeats, measured in three sittings (before the
runs, between them and after them), so that a machine whose speed drifts during the bench (shared VMs
do) moves the floor with the runs as far as a median can. Printed: step / floor for both
runs, each phase of the synchronous run over its own floor (rollout + reward vs generate, train vs
train, sync vs broadcast), and the runs' wall times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import (
    ASYNC_OVERRIDES,
    ROOT,
    bench_main,
    free_port,
    install_signal_handlers,
    run_meta,
    train_tiny_arith,
)

DEFAULT_OUT = ROOT / "bench" / "results" / "loop_overhead.json"
PHASES = ("rollout", "reward", "train", "sync", "eval")
FLOORS = ("generate", "train", "broadcast")


def tiny_arith(overrides: list[str]) -> Any:
    from dsv4rl.config.compose import compose

    return compose("tiny_arith", overrides)


def step_prompts(cfg: Any) -> list[list[int]]:
    """The token ids of the first step's prompts, as the loop encodes them."""
    from dsv4rl.data.stream import build_prompt_stream
    from dsv4rl.model.tokenizer import load_tokenizer
    from dsv4rl.rollout.generate import encode_prompt

    tokenizer = load_tokenizer(cfg.model)
    return [encode_prompt(tokenizer, problem.prompt) for problem in build_prompt_stream(cfg).next_batch()]


def measure_generate(model: torch.nn.Module, cfg: Any, prompts: list[list[int]], repeats: int) -> dict:
    from dsv4rl.engine.generator import Generator, GenRequest
    from dsv4rl.engine.sampling import SamplingParams

    sampling = cfg.algo.sampling
    generator = Generator(model, max_batch_size=cfg.engine.max_batch_size, deterministic=True)
    runs, samples = [], []
    try:
        for repeat in range(repeats + 1):  # the first is a warm-up
            requests = [
                GenRequest(
                    list(ids),
                    SamplingParams(
                        max_new_tokens=sampling.max_new_tokens,
                        temperature=sampling.temperature,
                        top_p=sampling.top_p,
                        top_k=sampling.top_k,
                        sampling_seed=1000 * repeat + i,
                    ),
                    return_logprob=True,
                )
                for i, ids in enumerate(ids for ids in prompts for _ in range(cfg.algo.group_size))
            ]
            start = time.perf_counter()
            generator.submit(requests)
            for request in requests:
                request.done.wait()
            if repeat:
                runs.append(time.perf_counter() - start)
            samples = requests
    finally:
        generator.close()
    return {"runs_seconds": runs, "samples": len(samples)}, samples


def measure_train(model_dir: str, cfg: Any, requests: list[tuple], repeats: int) -> dict:
    """`requests`: (prompt ids, output ids, output log-probs) of each generated sample."""
    from dsv4rl.algo.grpo import token_logprobs
    from dsv4rl.algo.loss import micro_batch_loss
    from dsv4rl.model.native_checkpoint import load_native_model
    from dsv4rl.samples import Sample
    from dsv4rl.train.batch import TrainBatch

    model = load_native_model(model_dir, dtype=torch.float32).eval()
    optim = cfg.optim
    # fused, as the FSDP backend's: the floor is the fastest known way to take this step
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, fused=True
    )
    samples = [
        Sample(i // cfg.algo.group_size, list(prompt), list(output), list(logprobs), "", "length")
        for i, (prompt, output, logprobs) in enumerate(requests)
    ]
    for i, sample in enumerate(samples):
        sample.advantage = 1.0 if i % 2 else -1.0
    batch = TrainBatch.from_samples(samples, pad_id=0).trimmed()
    temperature = cfg.algo.sampling.temperature
    runs = []
    for repeat in range(repeats + 1):
        start = time.perf_counter()
        logits = model(input_ids=batch.input_ids, use_cache=False).logits
        logprobs = token_logprobs(logits, batch.input_ids, temperature)
        out = micro_batch_loss(
            logprobs,
            logits,
            logprobs.detach(),
            batch.advantages,
            batch.loss_mask,
            cfg.algo,
            temperature,
        )
        (out.loss_sum / batch.loss_mask.sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if repeat:
            runs.append(time.perf_counter() - start)
    return {
        "runs_seconds": runs,
        "sequences": batch.size,
        "width": batch.input_ids.shape[1],
    }


def serve_peer(port: int, size: int) -> None:
    """Rank 1 of the broadcast group: on each `recv` line, receive `size` bytes into fresh memory."""
    import torch.distributed as dist

    from dsv4rl.wire.process_group import destroy_custom_process_group, init_custom_process_group

    group = init_custom_process_group(
        "gloo", f"tcp://127.0.0.1:{port}", world_size=2, rank=1, group_name="bench_loop", timeout=300
    )
    print("joined", flush=True)
    for line in sys.stdin:
        if line.strip() != "recv":
            break
        dist.broadcast(torch.empty(size, dtype=torch.uint8), src=0, group=group)
        dist.barrier(group=group)
    destroy_custom_process_group(group)


def measure_broadcast(model: torch.nn.Module, repeats: int) -> dict:
    import torch.distributed as dist

    from dsv4rl.wire.process_group import destroy_custom_process_group, init_custom_process_group

    tensors = [t.detach().contiguous() for t in model.state_dict().values()]
    size = sum(t.numel() * t.element_size() for t in tensors)
    port = free_port()
    peer = subprocess.Popen(
        [sys.executable, __file__, "--peer", str(port), str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    group = init_custom_process_group(
        "gloo", f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name="bench_loop", timeout=300
    )
    runs = []
    try:
        assert peer.stdout.readline().strip() == "joined"
        for repeat in range(repeats + 1):
            peer.stdin.write("recv\n")
            peer.stdin.flush()
            start = time.perf_counter()
            buffer = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])  # the sync flattens too
            dist.broadcast(buffer, src=0, group=group)
            dist.barrier(group=group)
            if repeat:
                runs.append(time.perf_counter() - start)
    finally:
        peer.stdin.write("exit\n")
        peer.stdin.flush()
        destroy_custom_process_group(group)
        peer.wait(timeout=30)
    return {"runs_seconds": runs, "bytes": size, "tensors": len(tensors)}


def run_dsv4rl(steps: int, overrides: list[str], run_dir: Path) -> dict:
    """`dsv4rl train recipe=tiny_arith` as a user runs it; the mean of each phase after the first 2 steps."""
    wall, records = train_tiny_arith(steps, overrides, run_dir)
    steady = records[2:] or records
    phases = {p: statistics.mean(r.get(f"time_{p}_s", 0.0) for r in steady) for p in PHASES}
    step = statistics.mean(r["time_step_s"] for r in steady)
    rewards = [r["reward_mean"] for r in records]
    return {
        "steps": steps,
        "wall_s": wall,
        "step_s": step,
        **{f"{p}_s": v for p, v in phases.items()},
        "other_s": step - sum(phases.values()),
        "last10_reward": statistics.mean(rewards[-10:]),
        "overrides": overrides,
    }


def floor_process(
    role: str, model_dir: str, threads: int, repeats: int, samples_path: str, overrides: str
) -> None:
    """One floor in a process of its own, which prints its JSON (`--floor`). As in the run, the process
    is fresh and computes on one thread's OpenMP team: a process whose second thread has run parallel
    ops too (the Generator's worker, then the main thread) has libgomp manage more threads than cores,
    and libgomp then stops spinning between parallel regions, which made later floors several times
    slower in one process."""
    from dsv4rl.model.native_checkpoint import load_native_model
    from dsv4rl.train.worker import freeze_own_gc as freeze_gc  # as the run's processes do

    cfg = tiny_arith(json.loads(overrides))
    torch.set_num_threads(threads)
    path = Path(samples_path)
    if role == "generate":
        model = load_native_model(model_dir, dtype=torch.float32).eval()
        freeze_gc()
        result, requests = measure_generate(model, cfg, step_prompts(cfg), repeats)
        triples = [(r.input_ids, r.output_ids, r.output_logprobs) for r in requests]
        path.write_text(json.dumps(triples))
    else:
        requests = json.loads(path.read_text())
        freeze_gc()
        result = measure_train(model_dir, cfg, requests, repeats)
    print(json.dumps(result), flush=True)


def run_floor_process(
    role: str, model_dir: str, threads: int, repeats: int, samples: Path, overrides: list[str]
) -> dict:
    argv = [sys.executable, __file__, "--floor", role, model_dir, str(threads), str(repeats), str(samples),
            json.dumps(overrides)]  # fmt: skip
    proc = subprocess.run(
        argv, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(threads)}
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the {role} floor failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_floor(
    model_dir: str, threads: dict[str, int], repeats: int, overrides: list[str]
) -> dict[str, dict]:
    """One sitting of every floor, each in a fresh process on the threads its process gets in the run."""
    from dsv4rl.model.native_checkpoint import load_native_model

    samples = Path(model_dir).parent / "floor-samples.json"
    generate = run_floor_process("generate", model_dir, threads["engine"], repeats, samples, overrides)
    train = run_floor_process("train", model_dir, threads["trainer"], repeats, samples, overrides)
    model = load_native_model(model_dir, dtype=torch.float32)
    return {"generate": generate, "train": train, "broadcast": measure_broadcast(model, repeats)}


def merge_sittings(sittings: list[dict[str, dict]]) -> dict[str, Any]:
    """Each floor's runs from every sitting and their median; `seconds` is the floor of a whole step."""
    floor: dict[str, Any] = {}
    for name in FLOORS:
        runs = [seconds for sitting in sittings for seconds in sitting[name]["runs_seconds"]]
        floor[name] = {**sittings[0][name], "runs_seconds": runs, "seconds": statistics.median(runs)}
    floor["seconds"] = sum(floor[name]["seconds"] for name in FLOORS)
    return floor


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dsv4rl.launcher.plan import build_local_plan
    from dsv4rl.model.model_dir import materialize_model

    install_signal_handlers()
    start = time.perf_counter()
    overrides = list(args.override)
    cfg = tiny_arith(overrides)
    repeats = 1 if args.quick else 5
    steps = args.steps or (8 if args.quick else 40)
    with tempfile.TemporaryDirectory(prefix="dsv4rl-loop-bench-") as tmp:
        plan = build_local_plan(cfg, Path(tmp) / "plan")
        threads = {spec.role: int(spec.env.get("OMP_NUM_THREADS", torch.get_num_threads())) for spec in plan}
        model_dir = materialize_model(cfg.model, str(Path(tmp) / "model"))
        # A floor sitting before, between and after the runs: the machine's drift moves both alike
        sittings = [measure_floor(model_dir, threads, repeats, overrides)]
        runs = {"dsv4rl": run_dsv4rl(steps, overrides, Path(tmp) / "sync")}
        if not args.no_async:
            sittings.append(measure_floor(model_dir, threads, repeats, overrides))
            runs["dsv4rl_async"] = run_dsv4rl(steps, [*ASYNC_OVERRIDES, *overrides], Path(tmp) / "async")
        sittings.append(measure_floor(model_dir, threads, repeats, overrides))
        floor = merge_sittings(sittings)
    dsv4rl = runs["dsv4rl"]
    ratios = {
        "step_vs_floor": dsv4rl["step_s"] / floor["seconds"],
        "rollout_vs_generate": (dsv4rl["rollout_s"] + dsv4rl["reward_s"]) / floor["generate"]["seconds"],
        "train_vs_train": dsv4rl["train_s"] / floor["train"]["seconds"],
        "sync_vs_broadcast": dsv4rl["sync_s"] / floor["broadcast"]["seconds"],
    }
    if "dsv4rl_async" in runs:
        ratios["async_step_vs_floor"] = runs["dsv4rl_async"]["step_s"] / floor["seconds"]
    sizes = {
        "steps": steps,
        "repeats": len(sittings) * repeats,
        "threads": threads,
        "samples": floor["generate"]["samples"],
    }
    meta = run_meta("loop_overhead", "quick" if args.quick else "full", sizes)
    meta["wall_seconds"] = time.perf_counter() - start
    return {
        "meta": meta,
        "floor": floor,
        **runs,
        "ratios": ratios,
        "targets": {"step_vs_floor": 1.25},
    }


def print_report(result: dict[str, Any]) -> None:
    floor, ours, ratios = result["floor"], result["dsv4rl"], result["ratios"]
    threads = ", ".join(f"{role} {n}" for role, n in result["meta"]["sizes"]["threads"].items())
    print(f"tiny_arith, {result['meta']['sizes']['samples']} samples a step, threads: {threads}")
    print(f"{'phase':<10}{'dsv4rl s':>10}{'floor s':>10}{'ratio':>8}")
    rows = [
        ("rollout", ours["rollout_s"] + ours["reward_s"], floor["generate"]["seconds"]),
        ("train", ours["train_s"], floor["train"]["seconds"]),
        ("sync", ours["sync_s"], floor["broadcast"]["seconds"]),
        ("step", ours["step_s"], floor["seconds"]),
    ]
    for name, mine, base in rows:
        print(f"{name:<10}{mine:>10.3f}{base:>10.3f}{mine / base:>8.2f}")
    print(f"eval {ours['eval_s']:.3f} s/step on average, other {ours['other_s']:.3f} s/step")
    if "dsv4rl_async" in result:
        mine = result["dsv4rl_async"]["step_s"]
        print(f"{'async step':<10}{mine:>10.3f}{floor['seconds']:>10.3f}{mine / floor['seconds']:>8.2f}")
    for name in ("dsv4rl", "dsv4rl_async"):
        if name in result:
            run = result[name]
            print(f"{name}: {run['steps']} steps in {run['wall_s']:.1f} s from command to exit, "
                  f"last-10 reward {run['last10_reward']:.3f}")  # fmt: skip
    print(json.dumps({"ratios": ratios}, indent=2))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--peer"]:
        serve_peer(int(argv[1]), int(argv[2]))
        return 0
    if argv[:1] == ["--floor"]:
        role, model_dir, threads, repeats, samples, overrides = argv[1:7]
        floor_process(role, model_dir, int(threads), int(repeats), samples, overrides)
        return 0
    return bench_main(
        __doc__,
        DEFAULT_OUT,
        "8 steps and one repeat of each floor (about a minute)",
        run,
        print_report,
        argv,
        extra_args=[
            (("--steps",), {"type": int, "default": 0, "help": "steps of the dsv4rl run (default 40)"}),
            (("--override",), {"action": "append", "default": [], "help": "a recipe override (repeatable)"}),
            (("--no-async",), {"action": "store_true", "help": "skip the run with async rollouts"}),
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
