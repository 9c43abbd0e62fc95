"""The recipe's engines as the trainer and the evaluator reach them: a client per engine of the topology,
waiting until they serve, freezing their garbage collectors once they are warm."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from dsv4rl.config.schema import Config
from dsv4rl.engine_client.client import EngineClient
from dsv4rl.engine_client.engine_keys import run_engine_keys
from dsv4rl.topology import topology
from dsv4rl.wire.engine_api import EngineAPI

__all__ = ["engine_clients", "freeze_engines_gc", "wait_for_engines"]

log = logging.getLogger("dsv4rl.rollout")


def engine_clients(cfg: Config) -> list[EngineClient]:
    """A client per engine of the recipe's topology; engines beyond loopback answer only the run's keys."""
    keys = run_engine_keys(cfg, Path(cfg.run.dir))
    return [
        EngineClient(
            url,
            timeout_s=cfg.engine.request_timeout_s,
            retries=cfg.engine.retries,
            max_concurrency=cfg.engine.max_concurrency,
            api_key=keys.api_key if keys else None,
            admin_api_key=keys.admin_api_key if keys else None,
        )
        for url in topology(cfg).engine_urls()
    ]


def wait_for_engines(
    cfg: Config, clients: Sequence[EngineAPI], event_loop: asyncio.AbstractEventLoop
) -> None:
    """Until every engine answers /health_generate (engine.startup_timeout_s): the trainer starts while the
    engines load, so its own start-up overlaps theirs."""
    started = time.monotonic()

    async def all_healthy() -> None:
        await asyncio.gather(*(client.wait_healthy(cfg.engine.startup_timeout_s) for client in clients))

    event_loop.run_until_complete(all_healthy())
    log.info("%d engine(s) healthy after %.1f s", len(clients), time.monotonic() - started)


def freeze_engines_gc(clients: Sequence[EngineAPI], event_loop: asyncio.AbstractEventLoop) -> None:
    """POST /freeze_gc to every engine, now that they are loaded and warm (`engine.freeze_gc`)."""

    async def freeze_all() -> None:
        await asyncio.gather(*(client.freeze_gc() for client in clients))

    event_loop.run_until_complete(freeze_all())
    log.info("froze the garbage collector of %d engine(s)", len(clients))
