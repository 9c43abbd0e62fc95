"""The judge (`reward.judge`): its prompt, its parse, its rate limits, and its errors; then a real judge
loop against the reference engine's /v1/chat/completions (the tiny model judges)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from dsv4rl.config.choices import RewardOnError
from dsv4rl.config.schema import RewardJudgeConfig
from dsv4rl.reward.inputs import RewardInput
from dsv4rl.reward.judge import JudgeScorer, RateLimiter, render, reply_parser, template_problem
from dsv4rl.reward.results import CallFailed, FnSpec

HERE = Path(__file__).resolve().parent
SAMPLE = RewardInput(prompt="3+4=", response="7", answer="7", ground_truth="7", metadata={"level": 2})


def judge(transport: httpx.AsyncBaseTransport, **options) -> JudgeScorer:
    cfg = RewardJudgeConfig(base_url="http://judge", **options)
    return JudgeScorer(FnSpec("judge", "j", 1.0, RewardOnError.zero, cfg.timeout_s), cfg, [HERE], transport,
                       backoff_s=0.01)  # fmt: skip


def replying(*contents: str, status: int = 200) -> tuple[httpx.MockTransport, list[dict]]:
    seen: list[dict] = []
    replies = iter(contents)

    def answer(request: httpx.Request) -> httpx.Response:
        import json

        seen.append(json.loads(request.content))
        text = next(replies)
        body = {"choices": [{"message": {"content": text}}], "usage": {"total_tokens": 30}}
        return httpx.Response(status, json=body) if status == 200 else httpx.Response(status, text=text)

    return httpx.MockTransport(answer), seen


def test_the_template_takes_the_samples_fields() -> None:
    assert (
        render("{prompt} -> {answer} ({ground_truth}, level {metadata[level]})", SAMPLE)
        == "3+4= -> 7 (7, level 2)"
    )
    assert template_problem("{prompt} {answr}").startswith("names ['answr'], not fields of a sample")
    assert "not a format string" in template_problem("{prompt")
    assert template_problem(RewardJudgeConfig().prompt_template) is None


@pytest.mark.parametrize(
    ("parse", "reply", "score"),
    [("number", "I give it 8/10", 8.0), ("number", "no digits", None), (r"Score: (\d+)", "x 3 Score: 9", 9.0),
     ("user_fns.py:number_in_brackets", "rating [[6.5]]", 6.5)],
)  # fmt: skip
def test_parse_takes_the_score_out_of_the_reply(parse: str, reply: str, score: float | None) -> None:
    assert reply_parser(parse, [HERE])(reply) == score


def test_scores_are_scaled_and_an_unparseable_reply_is_an_error() -> None:
    transport, seen = replying("8", "no idea")
    scorer = judge(transport, scale=0.1, model="m", max_tokens=5)
    first, second = asyncio.run(scorer.score([SAMPLE, SAMPLE]))
    assert first == {"score": pytest.approx(0.8), "raw": 8.0}
    assert isinstance(second, CallFailed) and second.error_type == "JudgeParseError"
    assert "no score in the judge's reply (parse='number'): 'no idea'" in second.message
    assert seen[0]["model"] == "m" and seen[0]["max_completion_tokens"] == 5
    assert "Response: 7" in seen[0]["messages"][0]["content"]


def test_429_is_retried_and_a_dead_judge_named() -> None:
    transport, _ = replying("busy", "busy", status=429)
    (failed,) = asyncio.run(judge(transport, retries=1).score([SAMPLE]))
    assert (
        failed.error_type == "JudgeError"
        and "HTTP 429" in failed.message
        and "after 2 attempts" in failed.message
    )


def test_rate_limits_hold_requests_and_tokens_per_minute() -> None:
    now = [0.0]
    limiter = RateLimiter(rpm=2, tpm=100, clock=lambda: now[0])
    assert limiter.wait_seconds(10) == 0.0
    limiter.events.extend([[0.0, 10.0], [1.0, 10.0]])
    assert limiter.wait_seconds(10) == 60.0  # two requests in the last minute: until the first leaves
    now[0] = 61.0
    assert limiter.wait_seconds(10) == 0.0
    tokens = RateLimiter(rpm=0, tpm=100, clock=lambda: now[0])
    tokens.events.extend([[50.0, 60.0], [55.0, 30.0]])
    assert tokens.wait_seconds(20) == pytest.approx(49.0)  # 60 + 30 + 20 > 100: until the first leaves
    assert tokens.wait_seconds(10) == 0.0
    RateLimiter.settle(tokens.events[0], 5.0)
    assert tokens.wait_seconds(60) == 0.0


@pytest.fixture
def engine_app(tmp_path: Path):  # noqa: ANN201
    import torch
    from fastapi.testclient import TestClient

    from dsv4rl.config.model_schema import ModelConfig
    from dsv4rl.engine.server import create_app
    from dsv4rl.model.model_dir import materialize_model

    threads = torch.get_num_threads()
    app = create_app(materialize_model(ModelConfig(), str(tmp_path / "tiny")), num_threads=1, random_seed=1)
    with TestClient(app):
        assert app.state.engine.ready.wait(30)
        yield app
    torch.set_num_threads(threads)


def test_a_judge_loop_against_the_reference_engine(engine_app) -> None:  # noqa: ANN001
    """The tiny model as the judge, through the reference engine's chat route (ASGI, no network)."""
    transport = httpx.ASGITransport(app=engine_app)
    scorer = judge(
        transport, prompt_template="{prompt}{answer}", parse=r"(\d)", max_tokens=3, temperature=0.0
    )
    results = asyncio.run(scorer.score([SAMPLE] * 4))
    assert len(results) == 4
    for result in results:  # a digit in the reply is its score; none is a parse error, named
        assert (
            isinstance(result, dict) and 0 <= result["score"] <= 9
        ) or result.error_type == "JudgeParseError"
