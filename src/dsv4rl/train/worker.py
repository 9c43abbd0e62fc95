"""The training rank: `torchrun ... -m dsv4rl.train.worker --config RUN_DIR/config.yaml [--task align]`.

Sets up the process group, the train engine and (on rank 0) the engines' clients, the weight sync
(with the wire format of what the engines serve), the data and the grader, then hands over to
`RLLoop` (`--task train`) or to `run_align` (`--task align`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import transformers

from dsv4rl.config.compose import load_config_file
from dsv4rl.config.rules_quant import engine_env
from dsv4rl.config.schema import Config
from dsv4rl.data.stream import build_prompt_stream
from dsv4rl.launcher.engine_keys import engine_keys_from_env
from dsv4rl.launcher.plan import engine_urls, source_model_dir
from dsv4rl.model.tiny import load_tokenizer
from dsv4rl.reward.graders import get_grader
from dsv4rl.rollout.client import EngineClient
from dsv4rl.sync.served_format import check_served_formats
from dsv4rl.sync.verify import SyncVerifier, probe_sequences
from dsv4rl.sync.weight_sync import WeightSync
from dsv4rl.train.align import run_align
from dsv4rl.train.engines import build_train_engine
from dsv4rl.train.loop import Driver, RLLoop

log = logging.getLogger("dsv4rl.train")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_driver(
    cfg: Config, run_dir: Path, model_path: str, event_loop: asyncio.AbstractEventLoop
) -> Driver:
    keys = engine_keys_from_env()  # engines beyond loopback answer only the run's keys
    clients = [
        EngineClient(
            url,
            timeout_s=cfg.engine.request_timeout_s,
            retries=cfg.engine.retries,
            max_concurrency=cfg.engine.max_concurrency,
            api_key=keys.api_key if keys else None,
            admin_api_key=keys.admin_api_key if keys else None,
        )
        for url in engine_urls(cfg)
    ]
    rollout = cfg.parallel.rollout
    # Each engine joins the group with one rank per tensor-parallel GPU (the reference engine: one).
    ranks_per_engine = 1 if rollout.engine.value == "reference" else rollout.tensor_parallel
    sync = WeightSync(
        clients,
        cfg.sync,
        backend=cfg.comm.backend.value,
        master_address=cfg.cluster.master_addr,
        master_port=cfg.cluster.weight_sync_port,
        engine_ranks=[ranks_per_engine] * len(clients),
    )
    # The tiny model builds its tokenizer; a model directory carries its own.
    tokenizer = load_tokenizer(
        cfg.model if cfg.model.path is None else replace(cfg.model, tokenizer=model_path)
    )
    return Driver(
        clients=clients,
        sync=sync,
        stream=build_prompt_stream(cfg),
        grader=get_grader(cfg.reward.grader, reward=cfg.reward),
        tokenizer=tokenizer,
        metrics_path=run_dir / "metrics.jsonl",
        event_loop=event_loop,
        verifier=SyncVerifier(clients, cfg.sync.verify, cfg.quant.name, event_loop),
    )


def connect(cfg: Config, driver: Driver, model_path: str) -> None:
    """Join the weight-update group, then learn what the engines serve: the wire format follows it."""
    log.info("joining the weight-update group of %d engine(s)", len(driver.clients))
    driver.sync.connect()
    driver.sync.wire_format = check_served_formats(
        driver.clients, cfg.quant, cfg.parallel.rollout.engine, engine_env(cfg), model_path, driver.event_loop
    )
    log.info("weights go to the engines as quant=%s", cfg.quant.name.value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="the resolved config.yaml the launcher wrote")
    parser.add_argument("--task", choices=("train", "align"), default="train")
    args = parser.parse_args(argv)
    cfg = load_config_file(args.config)
    run_dir = Path(cfg.run.dir)
    model_path = cfg.model.path or str(run_dir / "model")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(backend=cfg.comm.backend.value)
    rank = dist.get_rank()
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s",
        stream=sys.stdout,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP call drowns the step logs
    transformers.utils.logging.disable_progress_bar()
    seed_everything(cfg.seed + rank)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    event_loop = asyncio.new_event_loop()
    driver = None
    try:
        # align measures a trainer whose weights are off the engine's quantization grid: the source model
        trainer_path = (
            str(source_model_dir(run_dir)) if args.task == "align" and cfg.model.path is None else model_path
        )
        engine = build_train_engine(cfg, trainer_path, device)
        if rank == 0:
            driver = build_driver(cfg, run_dir, model_path, event_loop)
            connect(cfg, driver, model_path)
        if args.task == "align":
            run_align(cfg, engine, driver, run_dir)
            return 0
        verify = cfg.sync.verify
        probe = None
        if verify.logprob_probe:
            config = engine.hf_config
            probe = probe_sequences(
                config.vocab_size, verify.probe_sequences, verify.probe_length, bos=config.bos_token_id
            )
        RLLoop(cfg, engine, run_dir, driver, probe=probe).run()
        log.info("training finished")
        return 0
    finally:
        if driver is not None:
            driver.sync.close()
            close_grader = getattr(driver.grader, "close", None)  # math-verify keeps a process pool
            if close_grader is not None:
                close_grader()
            for client in driver.clients:
                event_loop.run_until_complete(client.aclose())
        event_loop.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
