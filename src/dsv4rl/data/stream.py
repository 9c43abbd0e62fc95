"""Batches of problems per training step, with a cursor that a checkpoint can save and restore.

Order: epoch k is a permutation of the problem indices that depends only on (seed, k) (identity when
`shuffle` is False); batches run across epoch boundaries. The cursor (epoch, position) is all the
state, so a run resumed from `state_dict()` draws exactly the batches the original run would have.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dsv4rl.config.schema import Config
from dsv4rl.data.chat_format import PromptRenderer
from dsv4rl.data.datasets import problem_source
from dsv4rl.data.problems import Problem

log = logging.getLogger(__name__)


class PromptStream:
    def __init__(
        self, problems_source: Sequence[Problem], batch_size: int, seed: int = 0, shuffle: bool = True
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (algo.prompts_per_step), got {batch_size}")
        if len(problems_source) == 0:
            raise ValueError("PromptStream needs at least one problem; the data source is empty")
        self.problems = problems_source
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # index into the current epoch's order
        self._order_epoch: int | None = None
        self._order: list[int] = []

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            order = list(range(len(self.problems)))
            if self.shuffle:
                random.Random(f"prompt-stream:{self.seed}:{self.epoch}").shuffle(order)
            self._order, self._order_epoch = order, self.epoch
        return self._order

    def next_batch(self) -> list[Problem]:
        batch: list[Problem] = []
        while len(batch) < self.batch_size:
            order = self._epoch_order()
            take = min(self.batch_size - len(batch), len(order) - self.position)
            batch.extend(self.problems[i] for i in order[self.position : self.position + take])
            self.position += take
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return batch

    def __iter__(self) -> Iterator[list[Problem]]:
        return self

    def __next__(self) -> list[Problem]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_problems": len(self.problems),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved cursor; refuses a cursor saved over a different problem set or order."""
        mismatched = [
            f"{key}: saved {state.get(key)!r}, now {now!r}"
            for key, now in (
                ("seed", self.seed),
                ("shuffle", self.shuffle),
                ("num_problems", len(self.problems)),
            )
            if state.get(key) != now
        ]
        if mismatched:
            raise ValueError(
                "cannot resume the prompt stream: the data or its order changed since the checkpoint ("
                + "; ".join(mismatched)
                + "); resume with the same data, seed and data.shuffle, or start a fresh run"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.problems):
            raise ValueError(f"invalid prompt-stream cursor epoch={epoch} position={position}")
        self.epoch, self.position = epoch, position


@dataclass(frozen=True)
class EncodedProblems:
    kept: list[Problem]  # with their prompt ids, at most max_prompt_len tokens each
    lengths: list[int]  # every problem's prompt length in tokens, in data-set order
    dropped: int  # problems whose rendered prompt is longer than max_prompt_len


def encode_problems(
    problems: Sequence[Problem], renderer: PromptRenderer, max_prompt_len: int, batch: int = 1024
) -> EncodedProblems:
    """Render and tokenize every problem once; drop those over `max_prompt_len` tokens (as sent)."""
    kept: list[Problem] = []
    lengths: list[int] = []
    for start in range(0, len(problems), batch):
        chunk = [problems[i] for i in range(start, min(start + batch, len(problems)))]
        for problem, ids in zip(chunk, renderer.encode([p.prompt for p in chunk]), strict=True):
            lengths.append(len(ids))
            if len(ids) <= max_prompt_len:
                kept.append(replace(problem, prompt_ids=tuple(ids)))
    return EncodedProblems(kept, lengths, len(lengths) - len(kept))


def build_prompt_stream(cfg: Config, renderer: PromptRenderer | None = None) -> PromptStream:
    """The recipe's prompt stream: `data` picks the problems, `algo.prompts_per_step` the batch size,
    `seed` and `data.shuffle` the order. With a `renderer` every prompt is encoded once, here, and
    prompts longer than `data.max_prompt_len` tokens are left out (counted in the log)."""
    problems = problem_source(cfg.data, cfg.seed)
    if renderer is not None:
        encoded = encode_problems(problems, renderer, cfg.data.max_prompt_len)
        if not encoded.kept:
            raise ValueError(
                f"every one of the {len(encoded.lengths)} prompts of data.name={cfg.data.name} is longer "
                f"than data.max_prompt_len={cfg.data.max_prompt_len} tokens as rendered (data.chat_format="
                f"{cfg.data.chat_format}; shortest {min(encoded.lengths)}): raise data.max_prompt_len"
            )
        if encoded.dropped:
            log.info(
                "%d of %d prompts are longer than data.max_prompt_len=%d tokens and left out",
                encoded.dropped, len(encoded.lengths), cfg.data.max_prompt_len,
            )  # fmt: skip
        problems = encoded.kept
    return PromptStream(problems, cfg.algo.prompts_per_step, seed=cfg.seed, shuffle=cfg.data.shuffle)
