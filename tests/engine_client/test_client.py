"""EngineClient against an in-process SGLang test double (and a MockTransport for transport faults)."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from dsv4rl.engine_client.client import EngineClient, EngineError, server_message

URL = "http://engine-a:30000"


def run(coro):
    return asyncio.run(coro)


def test_generate_single_batch_and_n(app, client_for):
    client = client_for(app)

    async def go():
        one = await client.generate([5, 6], {"max_new_tokens": 3}, return_logprob=True, rid="r1")
        batch = await client.generate([[1], [2]], {"max_new_tokens": 2})
        n = await client.generate([3], {"max_new_tokens": 1, "n": 4})
        return one, batch, n

    one, batch, n = run(go())
    assert one["output_ids"] == [11, 12, 13]
    assert one["meta_info"]["id"] == "r1"
    assert [lp[1] for lp in one["meta_info"]["output_token_logprobs"]] == [11, 12, 13]
    assert [b["output_ids"] for b in batch] == [[1, 2], [2, 3]]
    assert [s["output_ids"] for s in n] == [[3], [4], [5], [6]]


def test_generate_rejects_empty_input(app, client_for):
    with pytest.raises(ValueError, match="non-empty"):
        run(client_for(app).generate([], {}))


def test_generate_retries_503_then_succeeds(app, client_for):
    app.state.fail["/generate"] = [503, 502]
    out = run(client_for(app, retries=2).generate([1], {"max_new_tokens": 1}))
    assert out["output_ids"] == [1]
    assert app.state.calls["/generate"] == 3


def test_generate_gives_up_after_retries_naming_engine_and_endpoint(app, client_for):
    app.state.fail["/generate"] = [503, 503, 503, 503]
    with pytest.raises(EngineError) as info:
        run(client_for(app, retries=2).generate([1], {}))
    err = info.value
    assert (err.engine, err.endpoint, err.status) == (URL, "/generate", 503)
    assert URL in str(err) and "/generate" in str(err) and "upstream unavailable" in str(err)
    assert app.state.calls["/generate"] == 3


def test_generate_400_is_not_retried_and_carries_server_message(app, client_for):
    with pytest.raises(EngineError, match="unknown field `seed`") as info:
        run(client_for(app).generate([1], {"seed": 3}))
    assert info.value.status == 400
    assert app.state.calls["/generate"] == 1
    with pytest.raises(EngineError, match="max_new_tokens must be at least 0"):
        run(client_for(app).generate([1], {"max_new_tokens": -1}))


def test_generate_retries_connect_errors():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) < 3:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"output_ids": [7], "meta_info": {}})

    client = EngineClient(URL, transport=httpx.MockTransport(handler), retries=2, backoff_s=0.01)
    assert run(client.generate([1], {}))["output_ids"] == [7]
    assert len(calls) == 3


def test_unreachable_engine_real_socket():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    url = f"http://127.0.0.1:{port}"
    client = EngineClient(url, retries=1, backoff_s=0.01)
    with pytest.raises(EngineError, match=r"cannot connect \(after 2 attempts\)") as info:
        run(client.model_info())
    assert url in str(info.value) and "/model_info" in str(info.value)


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.update_weights_from_distributed(["embed.weight"], ["bfloat16"], [[4, 2]]),
        lambda c: c.init_weights_update_group("127.0.0.1", 29600, 1, 2, "g", "gloo"),
        lambda c: c.begin_weight_update(),
        lambda c: c.end_weight_update(),
        lambda c: c.pause_generation("retract"),
        lambda c: c.continue_generation(),
        lambda c: c.update_weight_version("v1"),
    ],
)
def test_control_posts_are_never_retried(app, client_for, call):
    for path in (
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/pause_generation",
        "/continue_generation",
        "/update_weight_version",
    ):
        app.state.fail[path] = [503]
    with pytest.raises(EngineError) as info:
        run(call(client_for(app, retries=5)))
    assert info.value.status == 503
    assert sum(app.state.calls.values()) == 1


def test_control_post_connect_error_is_not_retried():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        raise httpx.ConnectError("refused", request=request)

    client = EngineClient(URL, transport=httpx.MockTransport(handler), retries=3, backoff_s=0.01)
    with pytest.raises(EngineError, match="/begin_weight_update: cannot connect"):
        run(client.begin_weight_update())
    assert calls == ["/begin_weight_update"]


def test_weight_update_session_and_success_false(app, client_for):
    client = client_for(app)
    with pytest.raises(EngineError, match="must run between begin_weight_update") as info:
        run(client.update_weights_from_distributed(["a"], ["float32"], [[1]]))
    assert info.value.endpoint == "/update_weights_from_distributed" and info.value.status == 400

    async def cycle():
        await client.init_weights_update_group("127.0.0.1", 29600, 1, 2, "g", "gloo")
        await client.pause_generation("retract")
        await client.begin_weight_update()
        res = await client.update_weights_from_distributed(
            ["a"], ["float32"], [[1]], "g", weight_version="v1"
        )
        await client.end_weight_update()
        await client.flush_cache()
        version = await client.update_weight_version("v2")
        await client.continue_generation()
        info = await client.model_info()
        await client.destroy_weights_update_group("g")
        return res, version, info

    res, version, info = run(cycle())
    assert res["success"] and version["new_version"] == "v2" and info["weight_version"] == "v2"
    run(client.begin_weight_update())
    with pytest.raises(EngineError, match="already open"):
        run(client.begin_weight_update())
    with pytest.raises(EngineError, match="does not exist"):
        run(client.destroy_weights_update_group("nope"))


def test_success_false_with_http_200_raises(app, client_for):
    client = client_for(app)
    with pytest.raises(EngineError, match=r"/weights_say_no: HTTP 200: rank 0: bad \| rank 1: bad"):
        run(client._weights("/weights_say_no", {}))


def test_dtype_names_are_checked_before_sending(app, client_for):
    with pytest.raises(ValueError, match="bare torch names"):
        run(client_for(app).update_weights_from_distributed(["a"], ["torch.bfloat16"], [[1]]))
    assert app.state.calls["/update_weights_from_distributed"] == 0


def test_flush_cache_plain_text(app, client_for):
    client = client_for(app)
    assert run(client.flush_cache()).startswith("Cache flushed.")
    app.state.busy = True
    with pytest.raises(EngineError, match=r"/flush_cache: HTTP 400: Flush cache failed\."):
        run(client.flush_cache())


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (400, {"error": "unknown field `seed`"}, "unknown field `seed`"),
        (400, {"error": {"message": "bad range"}}, "bad range"),
        (400, {"success": False, "message": "no session"}, "no session"),
        (400, {"object": "error", "message": "validation", "type": "Bad Request", "code": 400}, "validation"),
        (422, {"detail": [{"loc": ["body"], "msg": "missing"}]}, "missing"),
    ],
)
def test_server_message_shapes(status, body, expected):
    assert expected in server_message(httpx.Response(status, json=body))


def test_server_message_plain_and_empty():
    assert server_message(httpx.Response(500, text="Internal Server Error")) == "Internal Server Error"
    assert server_message(httpx.Response(503)) == "Service Unavailable"


def test_concurrency_bound_is_respected(new_app, client_for):
    app = new_app(delay_s=0.02)
    client = client_for(app, max_concurrency=3)

    async def go():
        return await asyncio.gather(*(client.generate([i], {"max_new_tokens": 1}) for i in range(12)))

    outs = run(go())
    assert [o["output_ids"] for o in outs] == [[i] for i in range(12)]
    assert app.state.max_in_flight == 3
    assert client.in_flight == 0


def test_timeout_names_the_limit_and_is_not_retried(new_app, client_for):
    app = new_app(delay_s=2.0)
    client = client_for(app, timeout_s=0.1, retries=3)
    with pytest.raises(EngineError, match=r"engine http://engine-a:30000 /generate: timed out after 0.1 s"):
        run(client.generate([1], {}))
    assert app.state.calls["/generate"] == 1


def test_api_key_and_admin_key_headers(new_app, client_for):
    app = new_app(api_key="user-key", admin_api_key="admin-key")
    with pytest.raises(EngineError, match="HTTP 401: Unauthorized"):
        run(client_for(app).generate([1], {}))
    client = client_for(app, api_key="user-key", admin_api_key="admin-key")
    assert run(client.generate([1], {"max_new_tokens": 1}))["output_ids"] == [1]
    run(client.pause_generation())
    assert app.state.headers[-2:] == ["Bearer user-key", "Bearer admin-key"]
    with pytest.raises(EngineError, match="/pause_generation: HTTP 401"):
        run(client_for(app, api_key="user-key").pause_generation())


def test_wait_healthy_polls_until_200(app, client_for):
    app.state.starting = 2
    run(client_for(app).wait_healthy(5.0, min_interval_s=0.01, max_interval_s=0.02))
    assert app.state.calls["/health_generate"] == 3


def test_wait_healthy_timeout_says_how_long_and_last_status(app, client_for):
    app.state.starting = 10**6
    with pytest.raises(
        EngineError, match=r"not healthy after waiting 0\.\d s \(timeout 0.3 s\); last probe: HTTP 503"
    ):
        run(client_for(app).wait_healthy(0.3, min_interval_s=0.02, max_interval_s=0.05))


def test_wait_healthy_aborts_when_process_died(app, client_for):
    app.state.starting = 10**6
    polls = []

    def died() -> bool:
        polls.append(1)
        return len(polls) > 2

    with pytest.raises(EngineError, match="engine process exited while waiting"):
        run(client_for(app).wait_healthy(30.0, died, min_interval_s=0.01))


def test_wait_healthy_stops_probing_once_answered_elsewhere(app, client_for):
    """A probe is a generation on SGLang: once another process saw the engine answer, none is sent."""
    app.state.starting = 10**6
    checks = []

    def answered() -> bool:
        checks.append(1)
        return len(checks) > 2

    run(client_for(app).wait_healthy(30.0, answered_elsewhere=answered, min_interval_s=0.01))
    assert app.state.calls["/health_generate"] == 2


def test_client_survives_several_event_loops(app, client_for):
    client = client_for(app)
    assert run(client.health()) and run(client.health())
    app.state.starting = 1
    assert not run(client.health())

    async def close():
        await client.health()
        await client.aclose()

    run(close())
