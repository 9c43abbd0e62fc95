"""A remote reward service (FastAPI) speaking dsv4rl's reward contract, version 1 (docs/reward_contract.md).

    python examples/reward_server.py --port 8900
    dsv4rl train recipe=examples/remote.yaml reward.remote.url=http://127.0.0.1:8900/score

POST /score with `{"version": 1, "samples": [RewardInput as JSON, ...]}` answers
`{"version": 1, "results": [...]}`, one result per sample, in order: here the arithmetic check (1.0 when the
answer starts with the reference integer) plus the answer's length as a second logged number. Put your
own scoring in `score_sample` (a sandbox, a verifier, a model on its own GPUs).

`--faults` (for testing clients, never in production) lets a request pick a misbehaviour with the header
`X-Fault`: `slow` (sleeps 30 s), `flaky` (HTTP 500 on every other request), `malformed` (not JSON),
`short` (one result too few), `reject` (HTTP 422).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

CONTRACT_VERSION = 1
LEADING_INTEGER = re.compile(r"-?\d+(?!\.\d)(?!\d)")


def score_sample(sample: dict[str, Any]) -> dict[str, float] | None:
    """One sample's result: a number, a dict with "score" (and other numbers to log), or None (no score)."""
    answer = sample.get("answer")
    if answer is None:  # the thinking never closed: no answer to score
        return None
    match = LEADING_INTEGER.match(answer.strip())
    correct = match is not None and match.group() == str(sample.get("ground_truth", "")).strip()
    return {"score": 1.0 if correct else 0.0, "answer_chars": float(len(answer))}


def create_app(faults: bool = False) -> FastAPI:
    app = FastAPI(title="dsv4rl example reward service")
    calls = itertools.count()

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.post("/score")
    async def score(request: Request, x_fault: str | None = Header(default=None)) -> Response:
        body = await request.json()
        if body.get("version") != CONTRACT_VERSION:
            return JSONResponse({"error": f"contract version {body.get('version')!r} unsupported"}, 400)
        samples = body.get("samples") or []
        results = [score_sample(sample) for sample in samples]
        if faults and x_fault:
            if x_fault == "slow":
                await asyncio.sleep(30)
            elif x_fault == "flaky" and next(calls) % 2 == 0:
                return PlainTextResponse("overloaded, try again", status_code=500)
            elif x_fault == "malformed":
                return PlainTextResponse("<html>oops</html>", status_code=200)
            elif x_fault == "short":
                results = results[:-1]
            elif x_fault == "reject":
                return JSONResponse({"error": "bad sample"}, status_code=422)
        return JSONResponse({"version": CONTRACT_VERSION, "results": results})

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8900)
    parser.add_argument("--faults", action="store_true", help="honour X-Fault headers (client tests only)")
    args = parser.parse_args()
    uvicorn.run(create_app(args.faults), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
