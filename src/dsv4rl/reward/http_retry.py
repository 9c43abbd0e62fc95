"""One JSON POST with retries, shared by the remote reward service and the judge.

Connection errors, timeouts, 5xx (and for a judge 429, honouring Retry-After) are retried with exponential
backoff; any other 4xx is the request's fault and is not retried. Every failure is a `RewardHTTPError`
naming the URL, what went wrong and the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx

from dsv4rl.reward.step_limits import NO_WATCH

BACKOFF_S = 0.5  # the first retry waits this long, then twice as long each time
MAX_BACKOFF_S = 30.0


class RewardHTTPError(RuntimeError):
    """A reward service or judge that could not be reached, refused, or answered nonsense."""


def backoff_seconds(attempt: int, base: float = BACKOFF_S, retry_after: str | None = None) -> float:
    """Seconds to wait before retry `attempt` + 1 (0-based): base * 2^attempt, capped; a numeric
    Retry-After header wins when longer."""
    wait = min(MAX_BACKOFF_S, base * 2**attempt)
    if retry_after:
        with contextlib.suppress(ValueError):  # an HTTP date: the exponential wait
            wait = max(wait, min(MAX_BACKOFF_S, float(retry_after)))
    return wait


async def post_json(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    what: str,
    timeout_s: float,
    retries: int,
    headers: dict[str, str] | None = None,
    retry_statuses: tuple[int, ...] = (),
    backoff_s: float = BACKOFF_S,
    fix: str = "",
) -> httpx.Response:
    """POST `body` to `url` until a 2xx answer (returned), at most 1 + `retries` attempts."""
    attempts = 1 + max(0, retries)
    content = json.dumps(body, default=str).encode()  # a data row's odd column (a date) as text
    headers = {"Content-Type": "application/json", **(headers or {})}
    last = ""
    for attempt in range(attempts):
        retry_after = None
        try:
            response = await client.post(url, content=content, headers=headers, timeout=timeout_s)
        except httpx.TimeoutException:
            last = f"no answer within timeout_s={timeout_s:g}"
        except httpx.ConnectError as error:
            last = f"cannot connect ({error or 'connection refused'})"
        except httpx.TransportError as error:
            last = f"the connection failed ({type(error).__name__}: {error})"
        else:
            status = response.status_code
            if status < 300:
                return response
            text = response.text[:300]
            if status >= 500 or status in retry_statuses:
                last, retry_after = f"HTTP {status}: {text!r}", response.headers.get("retry-after")
            else:
                raise RewardHTTPError(
                    f"{what} {url} refused the request: HTTP {status}: {text!r} (a 4xx is not retried: "
                    f"the request itself is wrong){'; ' + fix if fix else ''}"
                )
        if attempt + 1 < attempts:
            await asyncio.sleep(backoff_seconds(attempt, backoff_s, retry_after))
    raise RewardHTTPError(
        f"{what} {url}: {last} (after {attempts} attempt{'s' if attempts > 1 else ''} with exponential "
        f"backoff){'; ' + fix if fix else ''}"
    )


def json_reply(response: httpx.Response, what: str, url: str, expected: str) -> Any:
    """The JSON of a 2xx answer; RewardHTTPError quoting the body when it is not JSON."""
    try:
        return response.json()
    except ValueError as error:
        raise RewardHTTPError(
            f"{what} {url} answered HTTP {response.status_code} with a body that is not JSON ({error}): "
            f"{response.text[:200]!r}; it must answer {expected}"
        ) from None


class HTTPScorerClient:
    """The lazily opened httpx client of a scorer that calls a service (remote rewards, the judge), closed
    once at the end of the run; `close` is the synchronous half of the scorer protocol (nothing to do)."""

    _client: httpx.AsyncClient | None = None
    watch = NO_WATCH  # the RewardSet's (`step_limits`)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def close(self) -> None:
        pass
