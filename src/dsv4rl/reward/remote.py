"""A remote reward service (`reward.remote`): samples POSTed as JSON batches, one result back per sample.

The contract (docs/reward_contract.md, version `CONTRACT_VERSION`):
request  `{"version": 1, "samples": [RewardInput as JSON, ...]}`
answer   `{"version": 1, "results": [number | {"score": ..., ...} | null, ...]}` (one per sample, in order)

A group's samples go in batches of `batch_size`, at most `max_concurrency` POSTs in flight; failures
(after retries, `http_retry`) become the batch's samples' errors, worth what `on_error` says.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx

from dsv4rl.config.schema import RemoteRewardConfig
from dsv4rl.reward.http_retry import BACKOFF_S, HTTPScorerClient, RewardHTTPError, json_reply, post_json
from dsv4rl.reward.inputs import CONTRACT_VERSION, RewardInput
from dsv4rl.reward.results import CallFailed, FnSpec

WHAT = "remote reward"
EXPECTED = (
    '{"version": 1, "results": [one number, {"score": ...} or null per sample]} (docs/reward_contract.md)'
)


def request_body(samples: Sequence[RewardInput]) -> dict[str, Any]:
    return {"version": CONTRACT_VERSION, "samples": [s.to_json() for s in samples]}


def read_results(data: Any, n: int, url: str) -> list[Any]:
    """The `results` of a reply to `n` samples; RewardHTTPError naming the URL when malformed."""
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise RewardHTTPError(f"{WHAT} {url} answered {str(data)[:200]!r}, not {EXPECTED}")
    version = data.get("version", CONTRACT_VERSION)
    if version != CONTRACT_VERSION:
        raise RewardHTTPError(
            f"{WHAT} {url} speaks contract version {version!r}; dsv4rl sends version {CONTRACT_VERSION}"
        )
    results = data["results"]
    if len(results) != n:
        raise RewardHTTPError(
            f"{WHAT} {url} returned {len(results)} results for {n} samples; it must return one per sample, "
            "in the order sent"
        )
    return results


class RemoteScorer(HTTPScorerClient):
    """`reward.remote` as a scorer; one `httpx.AsyncClient` on the trainer's event loop."""

    def __init__(
        self,
        spec: FnSpec,
        cfg: RemoteRewardConfig,
        transport: httpx.AsyncBaseTransport | None = None,
        backoff_s: float = BACKOFF_S,
    ) -> None:
        self.spec, self.cfg, self.transport, self.backoff_s = spec, cfg, transport, backoff_s
        self.limit = asyncio.Semaphore(max(1, cfg.max_concurrency))
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(transport=self.transport)
        return self._client

    async def post(self, samples: Sequence[RewardInput]) -> list[Any]:
        """One batch: the service's results, or RewardHTTPError."""
        async with self.limit:
            response = await post_json(
                self.client(),
                self.cfg.url,
                request_body(samples),
                what=WHAT,
                timeout_s=self.cfg.timeout_s,
                retries=self.cfg.retries,
                headers=dict(self.cfg.headers),
                backoff_s=self.backoff_s,
                fix="is the service up at reward.remote.url, and answering within reward.remote.timeout_s?",
            )
        return read_results(json_reply(response, WHAT, self.cfg.url, EXPECTED), len(samples), self.cfg.url)

    async def _batch(self, samples: Sequence[RewardInput]) -> list[Any]:
        try:
            return await self.post(samples)
        except RewardHTTPError as error:
            return [CallFailed("RemoteRewardError", str(error))] * len(samples)

    async def score(self, samples: Sequence[RewardInput]) -> list[Any]:
        size = max(1, self.cfg.batch_size)
        batches = [samples[i : i + size] for i in range(0, len(samples), size)]
        results = await asyncio.gather(*(self.watch.call(self._batch(b), len(b)) for b in batches))
        return [result for batch in results for result in batch]
