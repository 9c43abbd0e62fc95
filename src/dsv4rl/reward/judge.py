"""A judge model as a reward (`reward.judge`): each sample's prompt, filled into `prompt_template`, is asked
of an OpenAI-compatible `/v1/chat/completions` endpoint (an SGLang engine serves one; the reference engine
too, on CPU), and `parse` takes the score out of the reply.

The judge is an engine the user starts (on GPUs of its own, or a hosted API): dsv4rl does not start it,
and `dsv4rl plan` lists it as an external service. Requests are limited three ways: `max_concurrency` in
flight, `rpm` requests and `tpm` tokens (prompt and completion) per minute over a sliding minute
(`RateLimiter`). Retries: connection errors, timeouts, 429 and 5xx (`http_retry`).
"""

from __future__ import annotations

import asyncio
import collections
import math
import os
import re
import string
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from dsv4rl.config.schema import RewardJudgeConfig
from dsv4rl.reward.http_retry import BACKOFF_S, HTTPScorerClient, RewardHTTPError, json_reply, post_json
from dsv4rl.reward.inputs import RewardInput, template_fields
from dsv4rl.reward.results import BadResult, CallFailed, FnSpec, call_failed, read_result
from dsv4rl.targets import BUILTIN, load, looks_like_target

WHAT = "judge"
CHAT_ROUTE = "/v1/chat/completions"
EXPECTED = '{"choices": [{"message": {"content": "..."}}]} (an OpenAI chat completion)'
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
WINDOW_S = 60.0


# ------------------------------------------------------------------------------------------- the prompt
def template_problem(template: str) -> str | None:
    """Why `template` cannot be filled from a `RewardInput`, or None."""
    allowed = set(template_fields(RewardInput(prompt="", response="", answer=None)))
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as error:
        return f"is not a format string ({error}); write fields as {{prompt}}, braces as {{{{ and }}}}"
    unknown = sorted({re.split(r"[.\[]", name)[0] for name in names} - allowed)
    if unknown:
        return f"names {unknown}, not fields of a sample; use {', '.join(sorted(allowed))}"
    return None


def render(template: str, sample: RewardInput) -> str:
    return template.format_map(template_fields(sample))


# ------------------------------------------------------------------------------------------- the score
def number_parser(reply: str) -> float | None:
    """The reply's first number, or None."""
    match = _NUMBER.search(reply)
    return float(match.group()) if match else None


def reply_parser(parse: str, base_dirs: list[Path]) -> Callable[[str], float | None]:
    """`parse` as a function of the reply's text: "number", a target (pkg.module:function or
    file.py:function, called in the trainer's process: keep it to text parsing), or a regex whose first
    group (else its whole match) is the number. Raises ValueError naming the fix."""
    if parse == "number":
        return number_parser
    if looks_like_target(parse) and not parse.startswith(BUILTIN):
        return load(parse, base_dirs)
    try:
        pattern = re.compile(parse)
    except re.error as error:
        raise ValueError(
            f"parse={parse!r} is neither 'number', a target (pkg.module:function) nor a regex ({error})"
        ) from None

    def by_regex(reply: str) -> float | None:
        match = pattern.search(reply)
        if match is None:
            return None
        text = match.group(1) if pattern.groups else match.group()
        number = _NUMBER.search(text or "")
        return float(number.group()) if number else None

    return by_regex


# ------------------------------------------------------------------------------------------- rate limits
class RateLimiter:
    """At most `rpm` requests and `tpm` tokens per sliding minute (0: no limit). A request reserves its
    estimated tokens; `settle` replaces the estimate with the reply's usage."""

    def __init__(self, rpm: int, tpm: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rpm, self.tpm, self.clock = rpm, tpm, clock
        self.events: collections.deque[list[float]] = collections.deque()  # [time, tokens]

    def _expire(self, now: float) -> None:
        while self.events and self.events[0][0] <= now - WINDOW_S:
            self.events.popleft()

    def wait_seconds(self, tokens: float) -> float:
        """How long a request of `tokens` must wait before it fits both limits (0: now)."""
        now = self.clock()
        self._expire(now)
        waits = [0.0]
        if self.rpm and len(self.events) >= self.rpm:
            waits.append(self.events[len(self.events) - self.rpm][0] + WINDOW_S - now)
        if self.tpm:
            budget = self.tpm - min(
                tokens, self.tpm
            )  # a request above the whole budget waits for an empty minute
            used = sum(e[1] for e in self.events)
            for event in self.events:  # the oldest first: when enough of them have left the window
                if used <= budget:
                    break
                used -= event[1]
                waits.append(event[0] + WINDOW_S - now)
        return max(waits)

    async def acquire(self, tokens: float) -> list[float]:
        while (wait := self.wait_seconds(tokens)) > 0:
            await asyncio.sleep(wait)
        event = [self.clock(), float(tokens)]
        self.events.append(event)
        return event

    @staticmethod
    def settle(event: list[float], tokens: float) -> None:
        event[1] = float(tokens)


def estimate_tokens(text: str, max_tokens: int) -> float:
    """A request's tokens before its reply: ~4 characters a token, plus the completion cap."""
    return math.ceil(len(text) / 4) + max_tokens


# ------------------------------------------------------------------------------------------- the scorer
class JudgeScorer(HTTPScorerClient):
    """`reward.judge` as a scorer: one chat completion per sample."""

    def __init__(
        self,
        spec: FnSpec,
        cfg: RewardJudgeConfig,
        base_dirs: list[Path],
        transport: httpx.AsyncBaseTransport | None = None,
        backoff_s: float = BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec, self.cfg, self.transport, self.backoff_s = spec, cfg, transport, backoff_s
        self.parse = reply_parser(cfg.parse, base_dirs)
        self.url = cfg.base_url.rstrip("/") + CHAT_ROUTE
        self.limit = asyncio.Semaphore(max(1, cfg.max_concurrency))
        self.rate = RateLimiter(cfg.rpm, cfg.tpm, clock)
        self._client: httpx.AsyncClient | None = None

    def headers(self) -> dict[str, str]:
        key = os.environ.get(self.cfg.api_key_env, "") if self.cfg.api_key_env else ""
        return {"Authorization": f"Bearer {key}"} if key else {}

    def request_body(self, text: str) -> dict[str, Any]:
        """SGLang's ChatCompletionRequest fields (checked against its contract in the tests)."""
        return {
            "model": self.cfg.model,
            "messages": [{"role": "user", "content": text}],
            "max_completion_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
        }

    async def ask(self, text: str) -> str:
        """The judge's reply to one prompt; RewardHTTPError when it cannot be had."""
        if self._client is None:
            self._client = httpx.AsyncClient(transport=self.transport)
        async with self.limit:
            event = await self.rate.acquire(estimate_tokens(text, self.cfg.max_tokens))
            response = await post_json(
                self._client,
                self.url,
                self.request_body(text),
                what=WHAT,
                timeout_s=self.cfg.timeout_s,
                retries=self.cfg.retries,
                headers=self.headers(),
                retry_statuses=(429,),
                backoff_s=self.backoff_s,
                fix="is the judge served at reward.judge.base_url under reward.judge.model?",
            )
        data = json_reply(response, WHAT, self.url, EXPECTED)
        try:
            content = data["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RewardHTTPError(f"{WHAT} {self.url} answered {str(data)[:200]!r}, not {EXPECTED}") from None
        usage = data.get("usage") or {}
        if isinstance(usage.get("total_tokens"), int):
            self.rate.settle(event, usage["total_tokens"])
        return content or ""

    async def _one(self, sample: RewardInput) -> Any:
        try:
            reply = await self.ask(render(self.cfg.prompt_template, sample))
        except RewardHTTPError as error:
            return CallFailed("JudgeError", str(error))
        try:
            score = self.parse(reply)
            value, _ = read_result(score)
        except BadResult as error:
            return CallFailed(
                "JudgeParseError", f"parse={self.cfg.parse!r} on the reply {reply[:200]!r}: {error}"
            )
        except Exception as error:
            return call_failed(error)
        if value is None:
            return CallFailed(
                "JudgeParseError",
                f"no score in the judge's reply (parse={self.cfg.parse!r}): {reply[:200]!r}; make the prompt "
                "ask "
                "for the format parse reads, or change reward.judge.parse",
            )
        return {"score": value * self.cfg.scale, "raw": value}

    async def score(self, samples: Sequence[RewardInput]) -> list[Any]:
        return list(await asyncio.gather(*(self.watch.call(self._one(s)) for s in samples)))
