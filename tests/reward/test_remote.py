"""The remote reward client against the example service (examples/reward_server.py), started for real on
loopback: the contract, and each fault named in a clear error (slow past the timeout, 500 then success,
connection refused, malformed JSON, wrong length, a 4xx)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dsv4rl.config.choices import RewardOnError
from dsv4rl.config.schema import RemoteRewardConfig
from dsv4rl.reward.http_retry import RewardHTTPError, backoff_seconds
from dsv4rl.reward.inputs import RewardInput
from dsv4rl.reward.remote import RemoteScorer
from dsv4rl.reward.results import CallFailed, FnSpec, RewardError
from dsv4rl.reward.rewarder import RewardSet
from free_ports import free_port

SERVER = Path(__file__).resolve().parents[2] / "examples" / "reward_server.py"


@pytest.fixture(scope="module")
def service():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port), "--faults"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the example reward service did not start: {proc.stdout.read().decode()}")
        time.sleep(0.1)
    yield f"{url}/score"
    proc.kill()  # a slow request may still be held: no graceful wait
    proc.wait(timeout=10)


def samples(n: int) -> list[RewardInput]:
    answers = ["7", "8", None, "7 is it"]
    return [RewardInput(prompt="3+4=", response=answers[i % 4] or "", answer=answers[i % 4], ground_truth="7",
                        index=i, metadata={"nested": {"a": [1, 2]}}) for i in range(n)]  # fmt: skip


def scorer(url: str, fault: str | None = None, **options) -> RemoteScorer:
    cfg = RemoteRewardConfig(url=url, headers={"X-Fault": fault} if fault else {}, **options)
    return RemoteScorer(FnSpec("remote", url, 1.0, RewardOnError.zero, cfg.timeout_s), cfg, backoff_s=0.05)


def post(remote: RemoteScorer, inputs: list[RewardInput]):  # noqa: ANN201
    async def go():  # noqa: ANN202
        try:
            return await remote.post(inputs)
        finally:
            await remote.aclose()

    return asyncio.run(go())


def test_scores_come_back_in_order_in_batches(service: str) -> None:
    remote = scorer(service, batch_size=3, max_concurrency=2)

    async def go():  # noqa: ANN202
        try:
            return await remote.score(samples(8))
        finally:
            await remote.aclose()

    results = asyncio.run(go())
    assert [r if r is None else r["score"] for r in results] == [1.0, 0.0, None, 1.0] * 2
    assert results[3]["answer_chars"] == 7.0


def test_500_then_success_is_retried(service: str) -> None:
    results = post(scorer(service, "flaky", retries=2), samples(2))
    assert [r["score"] for r in results] == [1.0, 0.0]


def test_slow_past_the_timeout_names_the_url_and_the_fix(service: str) -> None:
    started = time.monotonic()
    with pytest.raises(RewardHTTPError) as raised:
        post(scorer(service, "slow", timeout_s=0.3, retries=1), samples(1))
    message = str(raised.value)
    assert service in message and "no answer within timeout_s=0.3 (after 2 attempts" in message
    assert "reward.remote.timeout_s" in message and time.monotonic() - started < 5


def test_connection_refused(service: str) -> None:
    url = f"http://127.0.0.1:{free_port()}/score"
    with pytest.raises(RewardHTTPError, match=r"cannot connect .*after 3 attempts.*is the service up"):
        post(scorer(url, retries=2), samples(1))


def test_malformed_json(service: str) -> None:
    with pytest.raises(RewardHTTPError, match=r"body that is not JSON .*'<html>oops</html>'; it must answer"):
        post(scorer(service, "malformed"), samples(2))


def test_wrong_length(service: str) -> None:
    with pytest.raises(
        RewardHTTPError, match="returned 2 results for 3 samples; it must return one per sample"
    ):
        post(scorer(service, "short"), samples(3))


def test_a_4xx_is_not_retried(service: str) -> None:
    with pytest.raises(RewardHTTPError, match=r"refused the request: HTTP 422: .*bad sample.*not retried"):
        post(scorer(service, "reject", retries=5), samples(1))


def test_a_failed_batch_is_each_samples_error(service: str) -> None:
    remote = scorer(service, "malformed", batch_size=2)
    results = asyncio.run(remote.score(samples(3)))
    assert all(isinstance(r, CallFailed) and r.error_type == "RemoteRewardError" for r in results)


def test_backoff_doubles_and_honours_retry_after() -> None:
    assert [backoff_seconds(k, 0.5) for k in range(4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff_seconds(0, 0.5, retry_after="3") == 3.0 and backoff_seconds(10, 0.5) == 30.0


def test_a_service_slower_than_the_step_deadline_is_named(service: str) -> None:
    """Each request under its own timeout (60 s), but the round's scoring past reward.step_timeout_s: the
    run stops naming the service and its requests still unanswered."""
    rewards = RewardSet([scorer(service, "slow", batch_size=4)], None, 0.05, step_timeout_s=0.3)

    async def go():  # noqa: ANN202
        rewards.begin_round(1, 8)
        rewards.start_deadline()
        try:
            return await rewards.score_group(samples(8))
        finally:
            rewards.end_round()
            await rewards.aclose()

    with pytest.raises(RewardError) as raised:
        asyncio.run(go())
    message = str(raised.value)
    assert "reward scoring of step 1 did not finish within reward.step_timeout_s=0.3" in message
    assert f"the slowest is reward function 'remote' ({service}), 2 calls unfinished" in message
