"""The evaluating process of `dsv4rl eval`: `python -m dsv4rl.eval.worker --config RUN_DIR/config.yaml`.

The node supervisor starts it in the trainer's place, with the recipe's engines (the same engines, on the
same devices, with the same environment as training); it waits for them, samples the eval set on them,
grades, and writes RUN_DIR/eval.json. No trainer and no weight sync: the engines serve the recipe's model.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from dsv4rl.config.compose import load_config_file
from dsv4rl.engine_client.engines import engine_clients, freeze_engines_gc, wait_for_engines
from dsv4rl.eval.data import eval_problems
from dsv4rl.eval.run import eval_grader, evaluate_on_engines, write_report
from dsv4rl.eval.weights import scored_weights
from dsv4rl.faults import heartbeat
from dsv4rl.faults.child import child_process
from dsv4rl.model.tokenizer import run_tokenizer
from dsv4rl.rollout.generate import rollout_seed

log = logging.getLogger("dsv4rl.eval")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="the resolved config.yaml the launcher wrote")
    args = parser.parse_args(argv)
    cfg = load_config_file(args.config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run_dir = Path(cfg.run.dir)
    tokenizer = run_tokenizer(cfg.model)
    problems = eval_problems(cfg)
    grader = eval_grader(cfg)
    clients = engine_clients(cfg)
    event_loop = asyncio.new_event_loop()
    try:
        wait_for_engines(cfg, clients, event_loop)
        if cfg.engine.freeze_gc:
            freeze_engines_gc(clients, event_loop)
        log.info(
            "eval %s: %d problems x %d samples", cfg.eval.name, len(problems), cfg.eval.samples_per_problem
        )
        seed = rollout_seed(cfg.seed, 0) if cfg.engine.reproducible_sampling else None
        heartbeat.enter("eval")
        report = evaluate_on_engines(cfg, problems, clients, tokenizer, grader, event_loop, seed)
        report["weights"] = scored_weights(cfg.model.path, run_dir)  # which weights the engines served
        path = write_report(report, run_dir)
        log.info("eval %s: pass@1 %.4f, report %s", cfg.eval.name, report["pass@1"], path)
    finally:
        for client in clients:
            event_loop.run_until_complete(client.aclose())
        close = getattr(grader, "close", None)
        if close is not None:
            close()  # before the loop closes: the recipe's remote and judge clients close on it
        event_loop.close()
    return 0


if __name__ == "__main__":
    with child_process("eval"):
        code = main()
    sys.exit(code)
