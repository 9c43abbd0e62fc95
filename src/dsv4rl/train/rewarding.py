"""One generation round of a step with its reward: the engines generate, and each prompt's group is scored
as soon as its samples are back (`RewardSet.score_group`), so scoring overlaps the generation of the rest.

Only a reward whose scoring took more than half the generation time in the last round (`OVERLAP_WHEN`)
splits an engine's share of the prompts into several /generate calls, so that groups come back in waves
and are scored while the rest generate; otherwise (the rule graders, a cheap function) the engines get
the one call each they always got: the calls would cost more than the overlap hides.

A group whose scoring raises (on_error=fail, a limit of the step passed: `reward.step_limits`) stops the
round at once, generation included: a reward that always hangs must not cost the step its whole batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from dsv4rl.config.choices import ChatFormat
from dsv4rl.config.schema import Config
from dsv4rl.data.chat_response import ResponseParts
from dsv4rl.data.problems import Problem
from dsv4rl.reward.results import Outcome
from dsv4rl.reward.rewarder import RewardSet
from dsv4rl.rollout.choices import ChoiceRequest
from dsv4rl.rollout.generate import generate_samples, rollout_seed
from dsv4rl.rollout.reward_inputs import reward_inputs
from dsv4rl.rollout.trajectory import final_turn_text, generate_trajectories
from dsv4rl.samples import Sample
from dsv4rl.train.driver import Driver
from dsv4rl.wire.engine_api import EngineAPI

# /generate calls per engine when scoring overlaps generation: groups come back in this many waves
OVERLAP_CALLS_PER_ENGINE = 8
# Split the generation into those calls once the last round's scoring took longer than this share of its
# generation: below it the calls cost more (HTTP, the engine's batching) than the overlap hides.
OVERLAP_WHEN = 0.5


def calls_for(rewards: RewardSet) -> int:
    """/generate calls per engine: `OVERLAP_CALLS_PER_ENGINE` once scoring is slow enough to be worth
    hiding behind generation (`rewards.overlap`, set after each round), else one."""
    return OVERLAP_CALLS_PER_ENGINE if rewards.overlap and not rewards.cheap else 1


@dataclass
class Round:
    """A generation round: the samples (prompt-major), each one's reasoning/answer split (chat format
    only), each one's verdict per function, and when the last sample came back."""

    samples: list[Sample]
    problems: list[Problem]  # each sample's
    parts: list[ResponseParts] | None
    outcomes: list[dict[str, Outcome]]
    generate_s: float  # from the first call to the last sample back
    reward_tail_s: float  # scoring left after that (what overlap did not hide)


async def generate_and_score(
    cfg: Config,
    driver: Driver,
    problems: Sequence[Problem],
    step: int,
    attempt: int,
    first_index: int,
    calls_per_engine: int | None = None,
    clients: Sequence[EngineAPI] | None = None,
) -> Round:
    """Generate `problems`' groups on the engines and score each group as it arrives; `calls_per_engine`
    overrides `calls_for` (benchmarks), `clients` the engines that take requests now (the asynchronous
    stream sends each group to the least busy one)."""
    algo = cfg.algo
    clients = list(clients) if clients is not None else driver.live_clients()
    rewards: RewardSet = driver.rewards
    scoring = GroupScoring(driver, problems, step, first_index, cfg.data.chat_format != ChatFormat.none)
    started = time.monotonic()
    seed = rollout_seed(cfg.seed, step, attempt) if cfg.engine.reproducible_sampling else None
    if driver.multi_turn is not None:
        generation = generate_trajectories(
            clients,
            problems,
            driver.multi_turn.runner,
            algo.group_size,
            seed,
            scoring.on_group,
            reroute=driver.roster.reroute if driver.roster is not None else None,
        )
    else:
        generation = generate_samples(
            clients,
            problems,
            driver.tokenizer,
            algo.group_size,
            algo.sampling,
            seed=seed,
            renderer=driver.renderer,
            choices=ChoiceRequest(algo.routing_replay, algo.indexer_replay),
            on_group=scoring.on_group,
            requests_per_engine=calls_per_engine or calls_for(rewards),
            reroute=driver.roster.reroute if driver.roster is not None else None,
        )
    rewards.begin_round(step, len(problems) * algo.group_size)  # before any group can be back
    generating = asyncio.ensure_future(generation)
    tasks = scoring.tasks
    try:
        samples = await _unless_failed(generating, scoring.failed)
        generated = time.monotonic()
        rewards.start_deadline()
        scored = await _unless_failed(
            asyncio.gather(*(tasks[group] for group in sorted(tasks))), scoring.failed
        )
    except BaseException:
        generating.cancel()
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(generating, *tasks.values(), return_exceptions=True)
        raise
    finally:
        rewards.end_round()
    outcomes = [per_sample for group in scored for per_sample in group.outcomes]
    parts = scoring.parts
    split_parts = [p for group in sorted(parts) for p in parts[group]] if driver.parser is not None else None
    per_sample = [problems[s.group] for s in samples]
    done = time.monotonic()
    scoring_span = done - min(scoring.first_back, default=done)
    rewards.overlap = scoring_span > OVERLAP_WHEN * (generated - started)  # the next round's calls
    return Round(samples, per_sample, split_parts, outcomes, generated - started, done - generated)


class GroupScoring:
    """The scoring side of a round: each prompt's group, once generated (`on_group`, called by the
    rollout), is split by the response parser, made `RewardInput`s and scored in the background;
    `failed` holds the first group whose scoring raised."""

    def __init__(self, driver: Driver, problems: Sequence[Problem], step: int, first_index: int, chat: bool):
        self.driver = driver
        self.problems = problems
        self.step = step
        self.first_index = first_index
        self.chat = chat
        self.tasks: dict[int, asyncio.Task] = {}
        self.parts: dict[int, list[ResponseParts] | None] = {}
        self.first_back: list[float] = []  # when each group came back
        self.failed: asyncio.Future = asyncio.get_running_loop().create_future()  # its result: the task

    def on_group(self, group: int, samples: list[Sample]) -> None:
        self.first_back.append(time.monotonic())
        parser = self.driver.parser
        finals = [final_turn_text(self.driver.tokenizer, s) for s in samples]
        split = (
            [parser.parse(s.final_turn_ids, text) for s, text in zip(samples, finals, strict=True)]
            if parser is not None
            else None
        )
        self.parts[group] = split
        first = self.first_index + group * len(samples)
        inputs = reward_inputs(self.problems[group], samples, split, self.step, first, self.chat, finals)
        self.tasks[group] = asyncio.ensure_future(self.driver.rewards.score_group(inputs))
        self.tasks[group].add_done_callback(self._on_scored)

    def _on_scored(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and not self.failed.done():
            self.failed.set_result(task)


async def _unless_failed(work: asyncio.Future, failed: asyncio.Future):  # noqa: ANN202
    """`work`'s result, or the error of the first group whose scoring raised, whichever comes first
    (`work` is cancelled then, and when this is)."""
    try:
        await asyncio.wait({work, failed}, return_when=asyncio.FIRST_COMPLETED)
        if failed.done():
            failed.result().result()  # raises it
        return work.result()
    finally:
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
        elif not work.cancelled():
            work.exception()  # retrieved: the group's error is the one raised
