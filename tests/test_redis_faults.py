"""The Redis ledger when Redis fails: down, restarted empty, stalled. Each test owns its server."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import httpx
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gpu_asgi import GPUAdmissionMiddleware, LedgerUnavailable, LinearEstimator, QueueTimeout, TenantPolicy, gpu_bound
from gpu_asgi._ledger.redis.ledger import RedisLedger

from . import _redis
from ._backends import Clock, start
from ._redis import EMPTY, RedisServer, eventually, requires_redis_server
from ._redis_clock import clocked

pytestmark = requires_redis_server
own_redis_server, namespace = _redis.own_redis_server, _redis.namespace  # fixtures


def admitting_app(ledger: RedisLedger) -> Starlette:
    @gpu_bound()
    async def generate(request: Request) -> PlainTextResponse:
        await request.body()  # admission happens at the first body read
        return PlainTextResponse("generated")

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=1))
    return app


async def stall(server: RedisServer, seconds: float) -> asyncio.Future[object]:
    """Block the whole server for ``seconds`` (``DEBUG SLEEP``): a Redis that answers too late."""
    client = server.client()
    stalled = asyncio.ensure_future(asyncio.to_thread(client.execute_command, "DEBUG", "SLEEP", str(seconds)))
    await asyncio.sleep(0.1)  # the command is on the server
    stalled.add_done_callback(lambda _: client.close())
    return stalled


async def test_redis_down_fails_closed_with_503_then_recovers_without_a_restart(
    own_redis_server: RedisServer, namespace: str
) -> None:
    ledger = RedisLedger(own_redis_server.url, 1000, namespace=namespace, lease_ttl=1.5, redis_timeout=0.5)
    payload = {"prompt": "hello", "max_new_tokens": 10}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=admitting_app(ledger)), base_url="http://t"
    ) as client:
        assert (await client.post("/generate", json=payload)).status_code == 200
        own_redis_server.stop()
        started = time.monotonic()
        refused = await client.post("/generate", json=payload)
        assert time.monotonic() - started < 2.0
        assert refused.status_code == 503
        assert refused.headers["x-gpu-admission-reason"] == "ledger-unavailable"
        assert int(refused.headers["retry-after"]) >= 1
        problem = refused.json()
        assert problem["type"] == "urn:gpu-asgi:problem:ledger-unavailable"
        assert "unavailable" in problem["detail"] and "fails closed" in problem["detail"]
        assert not ledger.available and ledger.availability == "unavailable"  # what /health reads
        assert ledger.statistics().rejected_total.get("ledger-unavailable") == 1

        own_redis_server.start()  # same port, empty
        await eventually(lambda: ledger.availability == "available", timeout=5)  # the heartbeat reconnects
        assert (await client.post("/generate", json=payload)).status_code == 200
    await eventually(lambda: own_redis_server.ledger_state(namespace) == EMPTY)
    await ledger.aclose()


async def test_a_redis_restart_loses_no_bytes_still_held(own_redis_server: RedisServer, namespace: str) -> None:
    holder = RedisLedger(own_redis_server.url, 100, namespace=namespace, lease_ttl=1.5)
    other = RedisLedger(own_redis_server.url, 100, namespace=namespace, lease_ttl=1.5)
    held = await holder.reserve(40)
    await other.refresh_statistics()  # both workers have seen this Redis
    own_redis_server.stop()
    own_redis_server.start()  # no persistence: Redis forgot the lease, the GPU did not
    assert own_redis_server.ledger_state(namespace) == EMPTY
    # The other worker asks for everything at once: grants pause until the held lease is back.
    everything = asyncio.ensure_future(other.reserve(100))
    await eventually(lambda: own_redis_server.ledger_state(namespace)["reserved"] == 40)
    await asyncio.sleep(1.0)  # past the pause: 40 + 100 > 100, still waiting
    assert not everything.done()
    assert own_redis_server.ledger_state(namespace) == {**EMPTY, "reserved": 40, "leases": 1, "tickets": 1, "queued": 1}
    held.release()
    (await asyncio.wait_for(everything, 5)).release()
    await eventually(lambda: own_redis_server.ledger_state(namespace) == EMPTY)
    await holder.aclose()
    await other.aclose()


async def test_a_redis_stall_longer_than_the_lease_ttl_reaps_only_the_leases_nobody_renews(
    own_redis_server: RedisServer, namespace: str
) -> None:
    """Redis runs no script for three lease TTLs (stalled, or cut off from every worker; the
    injected clock jumps as its TIME would). Nobody could renew a lease meanwhile, so leases age
    one heartbeat across such a spell: the live holder's survives and nothing is granted over
    it, while the lease of a worker that died before the stall is reaped within one lease TTL of
    Redis serving again."""
    clock = Clock()
    kind = clocked(clock)  # heartbeat 10 s: the test moves the clock itself
    holder, asker, dead = (kind(own_redis_server.url, 100, namespace=namespace, lease_ttl=30.0) for _ in range(3))
    held = await holder.reserve(60)
    await dead.reserve(20)
    await asker.refresh_statistics()
    await dead.aclose()  # the worker dies: its lease is no longer renewed
    clock.advance(90)  # the stall: no script ran during it
    waiter = start(asker, 30)  # fits only once a lease is reaped
    await eventually(lambda: waiter.done() or own_redis_server.ledger_state(namespace)["queued"] == 1)
    assert not waiter.done() and own_redis_server.ledger_state(namespace)["reserved"] == 80
    for _ in range(2):  # Redis serves again: the live workers renew; the dead one's lease ages
        clock.advance(9)
        await holder.refresh_statistics()
        await asker.refresh_statistics()
    assert not waiter.done() and own_redis_server.ledger_state(namespace)["reserved"] == 80
    clock.advance(9)  # 10 + 27 s of serving time since its last renewal: past its 30 s
    await holder.refresh_statistics()
    granted = await asyncio.wait_for(waiter, 10)
    assert own_redis_server.ledger_state(namespace) == {**EMPTY, "reserved": 90, "leases": 2}
    held.release()
    granted.release()
    await eventually(lambda: own_redis_server.ledger_state(namespace) == EMPTY)
    await holder.aclose()
    await asker.aclose()


async def test_after_a_heartbeat_that_did_not_land_the_next_comes_half_a_heartbeat_later(
    own_redis_server: RedisServer, namespace: str
) -> None:
    """So a live worker renews its leases within half a heartbeat of Redis answering again: a
    spell without scripts ages a lease one heartbeat, and the lease (three heartbeats by default)
    keeps half a heartbeat to spare."""
    ledger = RedisLedger(own_redis_server.url, 100, namespace=namespace, lease_ttl=6.0)  # heartbeat 2 s
    scripts = ledger._scripts._scripts
    heartbeat = scripts["heartbeat"]
    beats: list[float] = []

    async def fails_twice(*args: Any, **options: Any) -> Any:
        beats.append(time.monotonic())
        if len(beats) <= 2:
            raise RedisConnectionError("injected")
        return await heartbeat(*args, **options)

    scripts["heartbeat"] = fails_twice  # type: ignore[assignment]
    async with ledger:
        await eventually(lambda: len(beats) >= 4, timeout=15)
    gaps = [later - earlier for earlier, later in itertools.pairwise(beats)]
    assert all(0.9 < gap < 1.6 for gap in gaps[:2]), gaps  # after each failed beat: half a heartbeat
    assert gaps[2] > 1.9, gaps  # after the one that landed: a whole heartbeat


async def test_local_fallback_admits_within_its_share_and_hands_over_on_recovery(
    own_redis_server: RedisServer, namespace: str
) -> None:
    ledger = RedisLedger(
        own_redis_server.url, 100, namespace=namespace, lease_ttl=1.5, redis_timeout=0.5,
        on_unavailable="local", local_share=0.5,
    )  # fmt: skip
    own_redis_server.stop()
    local = await ledger.reserve(30)
    assert not ledger.available and ledger.availability == "local"  # /health: degraded
    assert ledger.statistics().capacity_bytes == 50  # the local share is what admits now
    with pytest.raises(LedgerUnavailable, match="local share"):
        await ledger.reserve(60)  # fits the shared budget, never the local share
    with pytest.raises(QueueTimeout):
        await ledger.reserve(30, deadline=0.2)  # 30 + 30 > 50
    local_too = await ledger.reserve(20)

    own_redis_server.start()
    await eventually(lambda: ledger.available, timeout=5)
    # What was admitted locally is still on the GPU: it is put into the shared budget.
    await eventually(lambda: own_redis_server.ledger_state(namespace)["reserved"] == 50)
    shared = await ledger.reserve(50)
    assert own_redis_server.ledger_state(namespace)["reserved"] == 100
    assert ledger.statistics().capacity_bytes == 100
    for reservation in (local, local_too, shared):
        reservation.release()
    await eventually(lambda: own_redis_server.ledger_state(namespace) == EMPTY)
    await ledger.aclose()


async def test_local_fallback_divides_each_tenants_quota_as_it_divides_the_budget(
    own_redis_server: RedisServer, namespace: str
) -> None:
    """Two workers with local_share=0.5 admit a tenant with a quota of 30 bytes up to 15 each
    while Redis is away, so no more than its quota in all; a quota that rounds down to 0 bytes
    keeps one byte, as a budget does."""
    tenants = {"capped": TenantPolicy(quota_bytes=30), "tiny": TenantPolicy(quota_bytes=1)}
    options = {"lease_ttl": 1.5, "redis_timeout": 0.5, "on_unavailable": "local", "local_share": 0.5}
    workers = [
        RedisLedger(own_redis_server.url, 100, namespace=namespace, tenants=tenants, **options)  # type: ignore[arg-type]
        for _ in range(2)
    ]
    own_redis_server.stop()
    held = [await worker.reserve(15, tenant="capped") for worker in workers]
    for worker in workers:
        assert not worker.available
        with pytest.raises(QueueTimeout):
            await worker.reserve(1, tenant="capped", deadline=0.2)  # this worker's half of the quota is held
        with pytest.raises(LedgerUnavailable, match="local share"):
            await worker.reserve(20, tenant="capped")  # within the quota, never within half of it
        quotas = {row.name: row.quota_bytes for row in worker.statistics().tenants}
        assert (quotas["capped"], quotas["tiny"]) == (15, 1)
        held.append(await worker.reserve(1, tenant="tiny"))
    assert sum(r.nbytes for r in held if r.tenant == "capped") == 30

    own_redis_server.start()
    await eventually(lambda: all(worker.available for worker in workers), timeout=5)
    for reservation in held:
        reservation.release()
    await eventually(lambda: own_redis_server.ledger_state(namespace) == EMPTY)
    for worker in workers:
        await worker.aclose()


async def test_a_slow_redis_fails_admission_cleanly_within_the_redis_timeout(
    own_redis_server: RedisServer, namespace: str
) -> None:
    ledger = RedisLedger(own_redis_server.url, 100, namespace=namespace, lease_ttl=1.5, redis_timeout=0.3)
    holder = await ledger.reserve(100)
    waiter = asyncio.ensure_future(ledger.reserve(50))
    await eventually(lambda: own_redis_server.ledger_state(namespace)["queued"] == 1)
    stalled = await stall(own_redis_server, 2.0)
    started = time.monotonic()
    with pytest.raises(LedgerUnavailable):
        await ledger.reserve(10)
    with pytest.raises(LedgerUnavailable):
        await asyncio.wait_for(waiter, 2.0)  # a queued request fails at its next poll
    assert time.monotonic() - started < 1.9  # before Redis answers again
    await stalled
    await eventually(lambda: ledger.available, timeout=5)
    holder.release()
    # The queued request's exit may have given up during the stall; its ticket's TTL covers it.
    await eventually(lambda: own_redis_server.ledger_state(namespace) == EMPTY, timeout=10)
    (await ledger.reserve(100)).release()
    await ledger.aclose()


async def test_the_timeout_bounds_a_queued_request_even_when_redis_is_slower(
    own_redis_server: RedisServer, namespace: str
) -> None:
    """Once queued, a request gives up at its timeout (plus TIMEOUT_STATE_WAIT), whatever Redis
    does: here it stalls for longer than the timeout, within ``redis_timeout``. (Its first ask is
    bounded by ``redis_timeout``, not the timeout: it grants what fits at once, as in-process.)"""
    ledger = RedisLedger(own_redis_server.url, 100, namespace=namespace, lease_ttl=3.0, redis_timeout=10.0)
    holder = await ledger.reserve(100)
    begun = time.monotonic()
    waiter = asyncio.ensure_future(ledger.reserve(10, deadline=1.0))
    await eventually(lambda: own_redis_server.ledger_state(namespace)["queued"] == 1)
    stalled = await stall(own_redis_server, 3.0)
    with pytest.raises(QueueTimeout):
        await asyncio.wait_for(waiter, 10)
    assert time.monotonic() - begun < 2.5  # the timeout and at most 0.1 s, not the stall's 3 s
    await stalled
    holder.release()
    await eventually(lambda: own_redis_server.ledger_state(namespace) == EMPTY, timeout=10)
    await ledger.aclose()


async def test_releases_and_queue_exits_that_failed_while_redis_was_away_land_once_it_answers(
    tmp_path: Any, namespace: str
) -> None:
    """Redis goes away (stopped with its data on disk, then back: as a failover or a restart from
    persistence leaves it) while one worker holds a lease and another waits. The release and the
    waiter's exit fail all their tries; Redis comes back holding both. They are sent again by the
    first heartbeat that lands: a third request fits well within the lease TTL, which alone would
    have freed them (30 s here), and the queue is left as nobody holds it."""
    server = RedisServer(args=["--appendonly", "yes", "--appendfsync", "always", "--dir", str(tmp_path)]).start()
    ledgers = [
        RedisLedger(server.url, 100, namespace=namespace, lease_ttl=30.0, heartbeat=0.5, redis_timeout=0.3)
        for _ in range(3)
    ]
    holder, waiter_side, later = ledgers
    try:
        held = await holder.reserve(60)
        waiting = start(waiter_side, 80, deadline=20.0)
        await eventually(lambda: server.ledger_state(namespace)["queued"] == 1)
        server.stop()  # graceful: the lease and the ticket are on disk
        held.release()  # its tries fail: Redis is away
        with pytest.raises((LedgerUnavailable, QueueTimeout)):
            await asyncio.wait_for(waiting, 10)  # the waiter gives up; its exit fails too
        await eventually(lambda: all(not ledger._upkeep._tasks for ledger in (holder, waiter_side)), timeout=5)
        assert holder._upkeep.owed_releases and waiter_side._upkeep.owed_leaves  # what Redis is owed
        server.start()  # back, with the released lease and the abandoned ticket
        state = server.ledger_state(namespace)
        assert state["reserved"] == 60 and state["tickets"] >= 1, state
        took = time.monotonic()
        granted = await asyncio.wait_for(later.reserve(90, deadline=20.0), 15)
        assert time.monotonic() - took < 10.0  # heartbeats and the pause after a restart, not the 30 s TTL
        assert not holder._upkeep.owed_releases and not waiter_side._upkeep.owed_leaves
        granted.release()
        await eventually(lambda: server.ledger_state(namespace) == EMPTY)
    finally:
        for ledger in ledgers:
            await ledger.aclose()
        server.stop()
