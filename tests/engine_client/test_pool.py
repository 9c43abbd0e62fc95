"""EnginePool: least-loaded generate and concurrent control broadcasts."""

from __future__ import annotations

import asyncio

import pytest

from dsv4rl.engine_client.client import EngineError, EnginePool


def test_generate_spreads_over_engines(new_app, client_for):
    apps = [new_app(delay_s=0.02) for _ in range(3)]
    pool = EnginePool([client_for(a, url=f"http://engine-{i}:30000") for i, a in enumerate(apps)])

    async def go():
        return await asyncio.gather(*(pool.generate([i], {"max_new_tokens": 1}) for i in range(9)))

    outs = asyncio.run(go())
    assert sorted(o["output_ids"][0] for o in outs) == list(range(9))
    assert [a.state.calls["/generate"] for a in apps] == [3, 3, 3]


def test_sequential_generate_round_robins(new_app, client_for):
    apps = [new_app() for _ in range(2)]
    pool = EnginePool([client_for(a, url=f"http://engine-{i}:30000") for i, a in enumerate(apps)])

    async def go():
        for i in range(4):
            await pool.generate([i], {"max_new_tokens": 1})

    asyncio.run(go())
    assert [a.state.calls["/generate"] for a in apps] == [2, 2]


def test_broadcast_calls_every_engine(new_app, client_for):
    apps = [new_app() for _ in range(2)]
    pool = EnginePool([client_for(a, url=f"http://engine-{i}:30000") for i, a in enumerate(apps)])
    results = asyncio.run(pool.broadcast("update_weight_version", "v7"))
    assert [r["new_version"] for r in results] == ["v7", "v7"]
    assert all(a.state.version == "v7" for a in apps)


def test_broadcast_failure_names_the_engine_after_all_finished(new_app, client_for):
    apps = [new_app() for _ in range(3)]
    apps[1].state.session = True  # engine 1 refuses a second begin
    apps[2].state.session = True
    pool = EnginePool([client_for(a, url=f"http://engine-{i}:30000") for i, a in enumerate(apps)])
    with pytest.raises(EngineError, match="engine http://engine-1:30000 /begin_weight_update") as info:
        asyncio.run(pool.broadcast("begin_weight_update"))
    assert "1 more engine(s) failed" in info.value.__notes__[0] and "engine-2" in info.value.__notes__[0]
    assert apps[0].state.session  # the healthy engine still got its call


def test_broadcast_rejects_unknown_method(app, client_for):
    pool = EnginePool([client_for(app)])
    with pytest.raises(ValueError, match="unknown EngineClient method 'pause'.*pause_generation"):
        asyncio.run(pool.broadcast("pause"))
    with pytest.raises(ValueError):
        asyncio.run(pool.broadcast("_request"))


def test_empty_pool_rejected():
    with pytest.raises(ValueError, match="at least one"):
        EnginePool([])
