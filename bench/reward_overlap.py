"""Scoring overlapped with generation, and what `reward.fns` costs the tiny_arith demo, measured in one run.

    python bench/reward_overlap.py [--quick] [--steps N] [--out bench/results/reward_overlap.json]

1. Overlap. One reference engine (the tiny model, a subprocess); a step of 8 prompts x 8 samples, up to 16
   new tokens each, and a reward that takes 50 ms a sample (bench/slow_reward.py) in `reward.num_workers=2`
   worker processes. Measured per repeat: the generation alone (one /generate call, as without a reward to
   overlap), the reward's serial time (the function called for every sample in this process, one after
   the other), and the step as the loop runs it (`generate_and_score`: each group scored as soon as it is
   back). The overlap is real when step < generation + serial reward; the table also shows the floor
   without overlap, generation + serial / num_workers.
2. The demo. `dsv4rl train recipe=tiny_arith` for --steps steps with `reward.grader=arith`, then with
   `reward.fns=[{name: ok, target: examples/arith_reward.py:score}]` (the same check as a user's function,
   in the worker pool): wall seconds, mean step time after the first two steps, and the last-10 reward.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from _common import ROOT, Engines, bench_main, free_port, run_meta, train_tiny_arith

DEFAULT_OUT = ROOT / "bench" / "results" / "reward_overlap.json"
SLOW = f"{ROOT / 'bench' / 'slow_reward.py'}:score"
USER_FN = f"reward.fns=[{{name: ok, target: {ROOT / 'examples' / 'arith_reward.py'}:score}}]"
STEP = [
    "algo.prompts_per_step=8",
    "algo.group_size=8",
    "algo.sampling.max_new_tokens=64",
    "reward.num_workers=2",
]


def measure_overlap(repeats: int, log_dir: Path, calls: int | None = None) -> dict[str, Any]:
    from dsv4rl.config.compose import compose
    from dsv4rl.data.chat_format import ChatSettings, PromptRenderer
    from dsv4rl.data.stream import build_prompt_stream
    from dsv4rl.engine_client.client import EngineClient
    from dsv4rl.model.model_dir import materialize_model
    from dsv4rl.model.tokenizer import run_tokenizer
    from dsv4rl.reward.inputs import RewardInput
    from dsv4rl.reward.rewarder import RewardSet
    from dsv4rl.rollout.generate import generate_samples
    from dsv4rl.train.rewarding import OVERLAP_CALLS_PER_ENGINE, generate_and_score

    sys.path.insert(0, str(ROOT / "bench"))
    from slow_reward import score as slow_score

    cfg = compose("tiny_arith", [*STEP, f"reward.fns=[{{name: slow, target: {SLOW}}}]", "eval=none"])
    model_dir = materialize_model(cfg.model, str(log_dir / "model"))
    engines = Engines(log_dir, 60.0)
    port = free_port()
    argv = [sys.executable, "-m", "dsv4rl.engine", "--model-path", model_dir, "--port", str(port),
            "--num-threads", "1", "--log-level", "warning", "--random-seed", "0"]  # fmt: skip
    engines.start("engine", argv, port)
    loop = asyncio.new_event_loop()
    rows = []
    try:
        urls = engines.wait_ready(180)
        tokenizer = run_tokenizer(cfg.model)
        renderer = PromptRenderer(tokenizer, ChatSettings())
        rewards = RewardSet.from_config(cfg.reward, [ROOT])
        loop.run_until_complete(rewards.start())
        client = EngineClient(urls["engine"])
        driver = SimpleNamespace(clients=[client], tokenizer=tokenizer, renderer=renderer, parser=None,
                                 rewards=rewards, multi_turn=None, roster=None,
                                 live_clients=lambda: [client])  # fmt: skip
        stream = build_prompt_stream(cfg, renderer)
        algo = cfg.algo
        for repeat in range(-1, repeats + 1):  # two warm-ups: the first scores after generating, the second
            # splits (the engine learns to settle the calls into one batch)
            problems = stream.next_batch()
            started = time.perf_counter()
            samples = loop.run_until_complete(
                generate_samples(
                    driver.clients, problems, tokenizer, algo.group_size, algo.sampling, renderer=renderer
                )
            )
            generate_s = time.perf_counter() - started
            started = time.perf_counter()
            for index, s in enumerate(samples):
                slow_score(
                    RewardInput.from_sample(s, problems[s.group], step=0, index=index, answer=s.response_text)
                )
            serial_s = time.perf_counter() - started
            started = time.perf_counter()
            round_ = loop.run_until_complete(
                generate_and_score(cfg, driver, problems, repeat + 1, 0, 0, calls)
            )
            step_s = time.perf_counter() - started
            if repeat > 0:
                rows.append({"generate_s": generate_s, "serial_reward_s": serial_s, "step_s": step_s,
                             "step_generate_s": round_.generate_s, "reward_tail_s": round_.reward_tail_s,
                             "samples": len(samples)})  # fmt: skip
        rewards.close()
    finally:
        loop.close()
        engines.close()
    med = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    workers = cfg.reward.num_workers
    return {
        "rows": rows,
        "median": med,
        "num_workers": workers,
        "calls_per_engine": calls or OVERLAP_CALLS_PER_ENGINE,
        "no_overlap_floor_s": med["generate_s"] + med["serial_reward_s"] / workers,
        "step_vs_generate_plus_serial": med["step_s"] / (med["generate_s"] + med["serial_reward_s"]),
        "overlap_real": all(r["step_s"] < r["generate_s"] + r["serial_reward_s"] for r in rows),
    }


def measure_demo(steps: int, log_dir: Path) -> dict[str, Any]:
    runs = {}
    for name, overrides in (("grader", ["reward.grader=arith"]), ("fns", [USER_FN])):
        wall, metrics = train_tiny_arith(steps, overrides, log_dir / name)
        steady = metrics[2:] or metrics
        rewards = [m["reward_mean"] for m in metrics]
        runs[name] = {
            "wall_s": wall,
            "step_s_mean": statistics.mean(m["time_step_s"] for m in steady),
            "rollout_plus_reward_s_mean": statistics.mean(
                m["time_rollout_s"] + m["time_reward_s"] for m in steady
            ),
            "last10_reward": statistics.mean(rewards[-10:]),
            "steps": len(metrics),
        }
    runs["wall_ratio"] = runs["fns"]["wall_s"] / runs["grader"]["wall_s"]
    runs["step_ratio"] = runs["fns"]["step_s_mean"] / runs["grader"]["step_s_mean"]
    return runs


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    steps = args.steps or (5 if args.quick else 120)
    repeats = 1 if args.quick else 3
    meta = run_meta(
        "reward_overlap", "quick" if args.quick else "full", {"demo_steps": steps, "repeats": repeats}
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="dsv4rl-bench-") as tmp:
        overlap = measure_overlap(repeats, Path(tmp), args.calls)
        demo = measure_demo(steps, Path(tmp)) if not args.no_demo else None
    meta["wall_seconds"] = time.monotonic() - started
    return {"meta": meta, "overlap": overlap, "demo": demo}


def report(result: dict[str, Any]) -> None:
    o = result["overlap"]
    m = o["median"]
    print(
        f"overlap: {m['samples']} samples, 50 ms each, {o['num_workers']} workers "
        f"(medians of {len(o['rows'])})"
    )
    print(f"  generation alone            {m['generate_s']:7.2f} s")
    print(f"  serial reward               {m['serial_reward_s']:7.2f} s")
    print(f"  generation + serial reward  {m['generate_s'] + m['serial_reward_s']:7.2f} s")
    print(f"  floor without overlap       {o['no_overlap_floor_s']:7.2f} s  (generation + serial / workers)")
    print(f"  step, scored as groups land {m['step_s']:7.2f} s  = {o['step_vs_generate_plus_serial']:.2f} x "
          f"(generation + serial); its generation {m['step_generate_s']:.2f} s, "
          f"reward tail {m['reward_tail_s']:.2f} s")  # fmt: skip
    print(f"  overlap real in every repeat: {o['overlap_real']}")
    demo = result["demo"]
    if demo:
        for name in ("grader", "fns"):
            d = demo[name]
            print(f"demo reward.{name:6} {d['steps']} steps: wall {d['wall_s']:7.1f} s, "
                  f"step {d['step_s_mean']:.3f} s, rollout+reward {d['rollout_plus_reward_s_mean']:.3f} s, "
                  f"last-10 reward {d['last10_reward']:.3f}")  # fmt: skip
        print(f"  fns / grader: wall x{demo['wall_ratio']:.3f}, step x{demo['step_ratio']:.3f}")


def main(argv: list[str] | None = None) -> int:
    return bench_main(
        __doc__, DEFAULT_OUT, "one repeat and a 5-step demo", run, report, argv,
        extra_args=[(("--steps",), {"type": int, "default": 0, "help": "demo steps (120; --quick: 5)"}),
                    (("--no-demo",), {"action": "store_true", "help": "only the overlap part"}),
                    (("--calls",), {"type": int, "default": None, "help": "/generate calls per engine"})],
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
