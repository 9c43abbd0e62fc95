"""The training rank: `torchrun ... -m dsv4rl.train.worker --config RUN_DIR/config.yaml [--task align]`.

Sets up the process group, the trainer backend, (on rank 0) the engines' clients, the data and the
grader, and the weight sync (on every pipeline stage's source rank a sender, with the wire format of
what the engines serve), then hands over to
`RLLoop` (`--task train`) or to `run_align` (`--task align`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import transformers

from dsv4rl.algo.staleness import staleness_bound
from dsv4rl.config.choices import RolloutEngineKind, Task
from dsv4rl.config.compose import load_config_file, reward_base_dirs
from dsv4rl.config.schema import Config
from dsv4rl.data.chat_format import PromptRenderer, data_chat_settings
from dsv4rl.data.chat_response import ResponseParser
from dsv4rl.data.stream import build_prompt_stream
from dsv4rl.engine_client.client import EngineClient
from dsv4rl.engine_client.colocated import ColocatedEngines
from dsv4rl.engine_client.engines import engine_clients, freeze_engines_gc, wait_for_engines
from dsv4rl.engine_client.roster import EngineRoster, restart_budget
from dsv4rl.eval.periodic import PeriodicEval
from dsv4rl.faults.child import child_process
from dsv4rl.faults.stop import StopSignals
from dsv4rl.model.model_dir import source_model_dir
from dsv4rl.model.tokenizer import run_tokenizer
from dsv4rl.model.wire_format import WireFormat
from dsv4rl.quant.sglang_env import engine_env
from dsv4rl.quant.sglang_moe import recipe_moe_path, restart_reason
from dsv4rl.reward.rewarder import RewardSet
from dsv4rl.rollout.multi_turn import build_multi_turn
from dsv4rl.sync.served_format import check_served_formats
from dsv4rl.sync.served_model import check_served_models
from dsv4rl.sync.stages import StagedWeightSync
from dsv4rl.sync.verify import SyncVerifier, probe_sequences
from dsv4rl.sync.weight_sync import WeightSync
from dsv4rl.topology import sync_transport, weight_sync_sources
from dsv4rl.train.align import run_align
from dsv4rl.train.attribute import run_attribution
from dsv4rl.train.backend import TrainerBackend, build_backend
from dsv4rl.train.driver import Driver
from dsv4rl.train.loop import RLLoop

log = logging.getLogger("dsv4rl.train")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_driver(
    cfg: Config,
    run_dir: Path,
    model_path: str,
    clients: list[EngineClient],
    event_loop: asyncio.AbstractEventLoop,
) -> Driver:
    # The tiny model builds its tokenizer; a model directory carries its own.
    tokenizer = run_tokenizer(cfg.model)
    multi_turn = build_multi_turn(cfg, tokenizer, data_chat_settings(cfg.data), reward_base_dirs(cfg))
    renderer = (
        multi_turn.renderer
        if multi_turn is not None
        else PromptRenderer(tokenizer, data_chat_settings(cfg.data))
    )
    rewards = RewardSet.from_config(cfg.reward, reward_base_dirs(cfg))
    event_loop.run_until_complete(rewards.start())  # the reward workers import the user's modules now
    evaluator = None
    if cfg.eval is not None and cfg.eval.every_steps > 0:
        evaluator = PeriodicEval(cfg, clients, tokenizer, event_loop, run_dir)
    return Driver(
        clients=clients,
        stream=build_prompt_stream(cfg, renderer),
        rewards=rewards,
        tokenizer=tokenizer,
        metrics_path=run_dir / "metrics.jsonl",
        event_loop=event_loop,
        verifier=SyncVerifier(clients, cfg.sync.verify, cfg.quant.name, event_loop, cfg.engine.numerics),
        evaluator=evaluator,
        colocated=ColocatedEngines(clients, event_loop) if cfg.parallel.colocate else None,
        renderer=renderer,
        parser=ResponseParser(renderer) if renderer.settings.is_chat else None,
        multi_turn=multi_turn,
        roster=EngineRoster.from_config(cfg, clients) if restart_budget(cfg) > 0 else None,
    )


def build_weight_sync(
    cfg: Config, backend: TrainerBackend, clients: list[EngineClient] | None
) -> StagedWeightSync:
    """This rank's part in the weight sync: a sender when it is a pipeline stage's source rank.

    `clients` are rank 0's engine clients (shared with the driver); another source makes its own."""
    sources = weight_sync_sources(cfg)
    planned = [source.rank for source in sources]
    if planned != list(backend.weight_source_ranks):
        raise RuntimeError(
            f"the {cfg.parallel.train.backend.value} backend sends its stages from ranks "
            f"{list(backend.weight_source_ranks)}, but the plan placed the weight-sync groups for ranks "
            f"{planned} (stage s at rank s x world / pipeline_parallel): the backend's rank order differs"
        )
    rank = dist.get_rank()
    mine = next((source for source in sources if source.rank == rank), None)
    sender = None
    if mine is not None:
        clients = clients if rank == 0 else engine_clients(cfg)
        rollout = cfg.parallel.rollout
        # Each engine joins a group with one rank per tensor-parallel GPU (the reference engine: one).
        ranks_per_engine = 1 if rollout.engine == RolloutEngineKind.reference else rollout.tensor_parallel
        sender = WeightSync(
            clients,
            cfg.sync,
            backend=cfg.comm.backend.value,
            master_address=mine.address,
            master_port=mine.port,
            engine_ranks=[ranks_per_engine] * len(clients),
            group_name=mine.group_name,
            # K <= 1 syncs between rollouts: no request is in flight to pause; K >= 2 generates throughout
            pause=staleness_bound(cfg.algo) >= 2,
            transport=sync_transport(cfg),  # colocated: by tensor handles, no group
            non_idempotent=restart_reason(cfg),  # a failed push then stops the run: fresh engines needed
        )
    return StagedWeightSync(sources, rank, sender)


def connect(cfg: Config, weight_sync: StagedWeightSync, driver: Driver | None, model_path: str) -> None:
    """Join the weight-update groups, then learn what the engines serve: the wire format follows it."""
    if driver is not None:
        wait_for_engines(cfg, list(driver.clients), driver.event_loop)
        log.info(
            "joining %d weight-update group(s) with %d engine(s)",
            len(weight_sync.sources),
            len(driver.clients),
        )
    weight_sync.connect()

    def served_format() -> WireFormat | None:
        check_served_models(driver.clients, cfg.parallel.rollout.engine, model_path, driver.event_loop)
        return check_served_formats(
            driver.clients,
            cfg.quant,
            cfg.parallel.rollout.engine,
            engine_env(cfg),
            model_path,
            driver.event_loop,
            recipe_moe_path(cfg),
        )

    weight_sync.share_wire_format(served_format if driver is not None else None)
    if driver is not None:
        log.info("weights go to the engines as quant=%s", cfg.quant.name.value)
        if cfg.engine.freeze_gc:
            freeze_engines_gc(driver.clients, driver.event_loop)


def freeze_own_gc() -> None:
    """Collect, then move every object alive before the first step (imports, the model, the process
    groups) out of the collector's reach: a full collection otherwise walks all of them, a pause in the
    middle of a step. What the steps allocate is still collected."""
    gc.collect()
    gc.freeze()
    log.info("froze %d objects out of the garbage collector", gc.get_freeze_count())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="the resolved config.yaml the launcher wrote")
    parser.add_argument("--task", type=Task, choices=(Task.train, Task.align), default=Task.train)
    args = parser.parse_args(argv)
    # SIGINT is how the supervisor (through torchrun) stops a rank at once; SIGTERM and SIGUSR1 ask a
    # training rank to stop at its next step boundary (dsv4rl.faults.stop).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    stop_signals = StopSignals().install() if args.task == Task.train else None
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
    driver = weight_sync = None
    try:
        # align measures a trainer whose weights are off the engine's quantization grid: the source model
        aligning_tiny = args.task == Task.align and cfg.model.path is None
        trainer_path = str(source_model_dir(run_dir)) if aligning_tiny else model_path
        backend = build_backend(cfg, trainer_path, device)
        clients = engine_clients(cfg) if rank == 0 else None
        if clients is not None:
            driver = build_driver(cfg, run_dir, model_path, clients, event_loop)
        weight_sync = build_weight_sync(cfg, backend, clients)
        connect(cfg, weight_sync, driver, model_path)
        if args.task == Task.align:
            # align measures trainer against engine log-probs after its push itself: no probe (train/align.py)
            # `--attribute`: one engine start's share of the attribution grid (dsv4rl.train.attribute)
            task = run_align if cfg.align.attribute is None else run_attribution
            task(cfg, backend, driver, weight_sync, run_dir)
            return 0
        verify = cfg.sync.verify
        probe = None
        if verify.logprob_probe:
            config = backend.hf_config
            probe = probe_sequences(
                config.vocab_size, verify.probe_sequences, verify.probe_length, bos=config.bos_token_id
            )
        freeze_own_gc()
        loop = RLLoop(cfg, backend, run_dir, driver, weight_sync, probe=probe, stop_signals=stop_signals)
        loop.run()
        if loop.stopped_at is None:
            log.info("training finished")
        else:
            log.info("stopped after step %d: resume=auto (or resume=true) continues", loop.stopped_at)
        return 0
    finally:
        if weight_sync is not None:
            weight_sync.close()
        if driver is not None:
            event_loop.run_until_complete(driver.rewards.aclose())  # the remote's and the judge's clients
            driver.rewards.close()  # the reward worker pool, math-verify's
            if driver.evaluator is not None:
                driver.evaluator.close()
            for client in driver.clients:
                event_loop.run_until_complete(client.aclose())
        event_loop.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    with child_process("trainer", rank=int(os.environ.get("RANK", "0"))):  # torchrun's global rank
        code = main()
    sys.exit(code)
