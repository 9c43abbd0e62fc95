"""`Driver`: what only rank 0 holds for the loop. Its own module so that the loop and the round it
drives (`train.rewarding`) both name its type, and neither imports the other for it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dsv4rl.data.chat_format import PromptRenderer
from dsv4rl.data.chat_response import ResponseParser
from dsv4rl.data.stream import PromptStream
from dsv4rl.engine_client.client import EngineClient
from dsv4rl.engine_client.colocated import ColocatedEngines
from dsv4rl.engine_client.roster import EngineRoster
from dsv4rl.eval.periodic import PeriodicEval
from dsv4rl.reward.rewarder import RewardSet
from dsv4rl.rollout.multi_turn import MultiTurn
from dsv4rl.sync.verify import SyncVerifier


@dataclass
class Driver:
    """What only rank 0 holds: the engines, the data, the reward, the periodic eval and the metrics file."""

    clients: Sequence[EngineClient]
    stream: PromptStream
    rewards: RewardSet  # reward.fns (or the reward.grader short form), remote, judge
    tokenizer: object
    metrics_path: Path
    event_loop: asyncio.AbstractEventLoop
    verifier: SyncVerifier
    evaluator: PeriodicEval | None = None  # the recipe's eval set every eval.every_steps steps
    colocated: ColocatedEngines | None = None  # parallel.colocate: the engines' memory around training
    renderer: PromptRenderer | None = None  # data.chat_format: problems -> the prompt ids sent
    parser: ResponseParser | None = None  # data.chat_format: responses -> reasoning and answer
    multi_turn: MultiTurn | None = None  # rollout.mode tools / env: trajectories with tool calls
    roster: EngineRoster | None = None  # engine.max_restarts > 0: the engines that take requests now

    def live_clients(self) -> list[EngineClient]:
        """The engines that take requests now: all of them, unless one was lost (`roster`)."""
        return self.roster.live() if self.roster is not None else list(self.clients)
