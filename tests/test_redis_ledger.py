"""The Redis ledger against a real redis-server: the in-process ledger's semantics, across workers.

Each ``RedisLedger`` here plays one worker process (its own client, ids and heartbeat); the
real multi-process runs are in test_redis_workers.py, the faults in test_redis_faults.py.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gpu_asgi import (
    BudgetLedger,
    GPUAdmissionMiddleware,
    Ledger,
    LinearEstimator,
    NeverFits,
    OverTenantQuota,
    QueueFull,
    QueueTimeout,
    Reservation,
    TenantPolicy,
    gpu_bound,
    gpu_reservation,
    ledger_from_url,
)
from gpu_asgi._ledger.drain import RATE_WINDOW
from gpu_asgi._ledger.redis import ledger as redis_ledger
from gpu_asgi._ledger.redis.ledger import RedisLedger

from . import _redis
from ._backends import Backend, Clock, open_ledgers, start
from ._redis import EMPTY, RedisServer, eventually, requires_redis_server
from ._redis_clock import redis_ledger as clocked_ledger

pytestmark = requires_redis_server
redis_server, namespace = _redis.redis_server, _redis.namespace  # fixtures

MakeLedger = Callable[..., RedisLedger]


@pytest.fixture
async def make_ledger(redis_server: RedisServer, namespace: str) -> AsyncIterator[MakeLedger]:
    """Ledgers on one namespace, one per simulated worker; closed at the end."""
    ledgers: list[RedisLedger] = []

    def make(capacity: int = 100, **options: object) -> RedisLedger:
        ledger = clocked_ledger(redis_server.url, capacity, namespace=namespace, **options)
        ledgers.append(ledger)
        return ledger

    yield make
    for ledger in ledgers:
        await ledger.aclose()


def queued(server: RedisServer, namespace: str, n: int) -> Callable[[], bool]:
    return lambda: server.ledger_state(namespace)["queued"] == n


async def still_waiting(*tasks: asyncio.Future[Reservation], settle: float = 0.3) -> bool:
    """None of ``tasks`` is admitted after the others have had time to be (capacity forbids it)."""
    await asyncio.sleep(settle)
    return not any(task.done() for task in tasks)


async def test_satisfies_the_budget_ledger_protocol(make_ledger: MakeLedger) -> None:
    ledger = make_ledger({"cuda:0": 100, "cuda:1": 50})
    assert isinstance(ledger, BudgetLedger)
    assert ledger.devices == ("cuda:0", "cuda:1")
    assert ledger.retry_after(10) == ledger.max_wait  # no release observed yet
    assert "namespace=" in repr(ledger)
    assert ledger.availability == "available"
    with pytest.warns(DeprecationWarning, match="reserve_if_free"):
        assert ledger.try_reserve(10) is None  # sync: it cannot ask Redis (kept for one release)


async def test_reserve_if_free_grants_what_fits_at_once_and_never_queues(
    make_ledger: MakeLedger, redis_server: RedisServer, namespace: str
) -> None:
    """As the in-process ledger's: the reserve script's no-queue mode grants what fits while
    nobody waits, and otherwise answers None without taking a ticket."""
    ledger = make_ledger(100)
    first = await ledger.reserve_if_free(60)
    assert first is not None and first.device == "cuda:0" and first.nbytes == 60
    assert await ledger.reserve_if_free(50) is None  # does not fit: nothing queued
    assert redis_server.ledger_state(namespace) == {"reserved": 60, "leases": 1, "tickets": 0, "queued": 0}
    waiter = start(ledger, 50)
    await eventually(queued(redis_server, namespace, 1))
    assert await ledger.reserve_if_free(10) is None  # fits in the 40 bytes free, but never ahead of a waiter
    assert redis_server.ledger_state(namespace) == {"reserved": 60, "leases": 1, "tickets": 1, "queued": 1}
    first.release()
    (await asyncio.wait_for(waiter, 5)).release()
    await eventually(lambda: redis_server.ledger_state(namespace)["reserved"] == 0)


async def test_reserve_and_release_return_every_byte_to_redis(
    make_ledger: MakeLedger, redis_server: RedisServer, namespace: str
) -> None:
    ledger = make_ledger(100)
    reservation = await ledger.reserve(60)
    assert (reservation.device, reservation.nbytes) == ("cuda:0", 60)
    assert redis_server.ledger_state(namespace) == {**EMPTY, "reserved": 60, "leases": 1}
    assert reservation.release() == 60
    assert reservation.release() == 0  # exactly once
    await eventually(lambda: redis_server.ledger_state(namespace) == EMPTY)
    stats = await ledger.refresh_statistics()
    assert (stats.reserved_bytes, stats.in_flight, stats.admitted_total) == (0, 0, 1)


async def test_a_burst_larger_than_the_connection_pool_is_admitted(
    make_ledger: MakeLedger, redis_server: RedisServer, namespace: str
) -> None:
    # redis-py 8 caps a pool at 100 connections and raises when it is exhausted; a busy worker
    # has more requests in admission than that, and must not read the cap as "Redis is down".
    ledger = make_ledger(1_000)

    async def hold(nbytes: int) -> int:
        reservation = await ledger.reserve(nbytes)
        await asyncio.sleep(0.01)
        return reservation.release()

    assert sum(await asyncio.gather(*(hold(1) for _ in range(300)))) == 300  # all fit at once
    assert sum(await asyncio.gather(*(hold(10) for _ in range(250)))) == 2_500  # 100 fit, the rest queue
    assert ledger.available
    await eventually(lambda: redis_server.ledger_state(namespace) == EMPTY)
    assert (await ledger.refresh_statistics()).admitted_total == 550


async def test_a_client_with_a_small_non_blocking_pool_waits_for_a_connection(
    redis_server: RedisServer, namespace: str
) -> None:
    # A client passed in keeps its own pool; redis-py's default one raises MaxConnectionsError
    # when every connection is busy. That must read as a burst, not as Redis being down.
    client = Redis.from_url(redis_server.url, max_connections=4)
    async with RedisLedger(client, 1_000, namespace=namespace) as ledger:
        reservations = await asyncio.gather(*(ledger.reserve(1) for _ in range(200)))
        assert ledger.available
        for reservation in reservations:
            reservation.release()
        await eventually(lambda: redis_server.ledger_state(namespace) == EMPTY)
    await client.aclose()


async def test_places_on_the_device_with_most_free_bytes(make_ledger: MakeLedger) -> None:
    ledger = make_ledger({"cuda:0": 100, "cuda:1": 100})
    first = await ledger.reserve(70)
    second = await ledger.reserve(70)
    assert {first.device, second.device} == {"cuda:0", "cuda:1"}
    pinned = await ledger.reserve(30, devices=[first.device])
    assert pinned.device == first.device
    for reservation in (first, second, pinned):
        reservation.release()


async def test_request_larger_than_budget_is_rejected_at_once(make_ledger: MakeLedger) -> None:
    ledger = make_ledger(100)
    with pytest.raises(NeverFits) as caught:
        await ledger.reserve(101)
    assert caught.value.extensions == {"required_bytes": 101, "budget_bytes": 100}
    with pytest.raises(ValueError, match="unknown device"):
        await ledger.reserve(1, devices=["cuda:7"])
    assert ledger.statistics().rejected_total == {"exceeds-budget": 1}  # this process's count, at once
    assert (await ledger.refresh_statistics()).rejected_total == {"exceeds-budget": 1}  # and Redis's


async def test_a_burst_of_refusals_before_redis_is_counted_exactly_without_a_call_each(
    make_ledger: MakeLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """exceeds-budget and exceeds-tenant-quota are decided in Python, before any call to Redis: the
    process counts them (its statistics() shows them at once) and its next heartbeat adds them to
    Redis in the same call; a heartbeat that fails keeps them for the next one."""
    tenants = {"capped": TenantPolicy(quota_bytes=10)}
    ledger, other = make_ledger(40, tenants=tenants), make_ledger(40, tenants=tenants)
    await ledger.refresh_statistics()
    calls: list[object] = []
    execute = ledger._client.execute_command

    async def counted(*args: Any, **options: Any) -> Any:
        calls.append(args[0])
        return await execute(*args, **options)

    monkeypatch.setattr(ledger._client, "execute_command", counted)

    async def refused(nbytes: int, tenant: str = "default") -> None:
        with pytest.raises((NeverFits, OverTenantQuota)):
            await ledger.reserve(nbytes, tenant=tenant)

    await asyncio.gather(*(refused(100) for _ in range(500)), *(refused(20, "capped") for _ in range(100)))
    counts = {"exceeds-budget": 500, "exceeds-tenant-quota": 100}
    assert ledger.statistics().rejected_total == counts
    await asyncio.sleep(0.2)  # time for any call the refusals started in the background
    assert len(calls) <= 2, calls  # at most the heartbeat's, never one per refusal

    scripts = ledger._scripts._scripts
    heartbeat = scripts["heartbeat"]

    async def fails_once(*args: Any, **options: Any) -> Any:
        scripts["heartbeat"] = heartbeat
        raise RedisConnectionError("injected")

    scripts["heartbeat"] = fails_once  # type: ignore[assignment]
    await ledger.refresh_statistics()
    assert scripts["heartbeat"] is heartbeat and not ledger.available  # that beat failed ...
    assert ledger.statistics().rejected_total == counts  # ... and kept the counts
    await ledger.refresh_statistics()
    assert (await other.refresh_statistics()).rejected_total == counts  # in Redis, each once
    await refused(100)
    await ledger.aclose()  # shutting down sends what no heartbeat has
    counts["exceeds-budget"] += 1
    assert (await other.refresh_statistics()).rejected_total == counts


async def test_waiters_of_two_workers_are_admitted_in_one_fifo_order(
    make_ledger: MakeLedger, redis_server: RedisServer, namespace: str
) -> None:
    workers = (make_ledger(100), make_ledger(100))
    holder = await workers[0].reserve(100)
    waiters = []
    for index in range(4):  # alternate workers; each ticket is taken before the next
        waiters.append(asyncio.ensure_future(workers[index % 2].reserve(100)))
        await eventually(queued(redis_server, namespace, index + 1))
    previous = holder
    for index, waiter in enumerate(waiters):
        previous.release()
        previous = await asyncio.wait_for(waiter, 5)
        assert await still_waiting(*waiters[index + 1 :], settle=0.1)  # only the next in line got it
    previous.release()
    await eventually(lambda: redis_server.ledger_state(namespace) == EMPTY)


async def test_later_small_requests_pass_a_blocked_head_at_most_max_bypass_times(make_ledger: MakeLedger) -> None:
    first, second = make_ledger(100, max_bypass=2), make_ledger(100, max_bypass=2)
    holder = await first.reserve(60)
    big = asyncio.ensure_future(first.reserve(80))  # heads the queue, does not fit
    await asyncio.sleep(0.1)
    small = [await asyncio.wait_for(second.reserve(10), 2) for _ in range(2)]  # the other worker passes twice
    third = asyncio.ensure_future(second.reserve(10))  # would fit, but the head is owed its turn
    assert await still_waiting(big, third)
    holder.release()
    for reservation in small:
        reservation.release()
    granted = await asyncio.wait_for(asyncio.gather(big, third), 5)
    assert [r.nbytes for r in granted] == [80, 10]
    for reservation in granted:
        reservation.release()


async def test_higher_priority_is_admitted_first_across_workers(
    make_ledger: MakeLedger, redis_server: RedisServer, namespace: str
) -> None:
    low_worker, high_worker = make_ledger(100), make_ledger(100)
    holder = await low_worker.reserve(100)
    low = asyncio.ensure_future(low_worker.reserve(100, priority=0))
    await eventually(queued(redis_server, namespace, 1))
    high = asyncio.ensure_future(high_worker.reserve(100, priority=5))
    await eventually(queued(redis_server, namespace, 2))
    holder.release()
    granted = await asyncio.wait_for(high, 5)
    assert await still_waiting(low, settle=0.1)
    granted.release()
    (await asyncio.wait_for(low, 5)).release()


async def test_the_queue_bound_is_shared_by_all_workers(
    make_ledger: MakeLedger, redis_server: RedisServer, namespace: str
) -> None:
    first, second = make_ledger(100, max_queue=2), make_ledger(100, max_queue=2)
    holder = await first.reserve(100)
    waiting = [asyncio.ensure_future(ledger.reserve(10)) for ledger in (first, second)]
    await eventually(queued(redis_server, namespace, 2))
    with pytest.raises(QueueFull) as caught:
        await first.reserve(10)
    assert caught.value.retry_after is not None and caught.value.retry_after >= 1
    holder.release()
    for reservation in await asyncio.wait_for(asyncio.gather(*waiting), 5):
        reservation.release()
    assert (await second.refresh_statistics()).rejected_total == {"queue-full": 1}


async def test_a_waiter_that_times_out_leaves_the_shared_queue(
    make_ledger: MakeLedger, redis_server: RedisServer, namespace: str
) -> None:
    holder_worker, waiter_worker = make_ledger(100), make_ledger(100)
    holder = await holder_worker.reserve(100)
    with pytest.raises(QueueTimeout) as caught:
        await waiter_worker.reserve(10, deadline=0.3)
    assert caught.value.status == 503
    await eventually(queued(redis_server, namespace, 0))
    holder.release()
    await eventually(lambda: redis_server.ledger_state(namespace) == EMPTY)
    assert (await holder_worker.refresh_statistics()).rejected_total == {"queue-timeout": 1}


async def test_a_waiter_cancelled_after_its_grant_passes_the_bytes_on(
    make_ledger: MakeLedger, redis_server: RedisServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder_worker = make_ledger(100)
    # No wake-ups and a long poll: the grant sits in Redis, unclaimed, when the waiter is cancelled.
    # Without a subscription a waiter polls at UNSUBSCRIBED_POLL_INTERVAL, not poll_interval: on a
    # loaded machine its 0.05 s let the waiter claim the grant before the test cancelled it.
    monkeypatch.setattr(redis_ledger, "UNSUBSCRIBED_POLL_INTERVAL", 30.0)
    sleepy = make_ledger(100, notify=False, poll_interval=30.0, lease_ttl=60.0)
    holder = await holder_worker.reserve(100)
    waiter = asyncio.ensure_future(sleepy.reserve(40))
    await eventually(queued(redis_server, namespace, 1))
    holder.release()
    await eventually(lambda: redis_server.ledger_state(namespace) == {**EMPTY, "reserved": 40, "leases": 1})
    assert not waiter.done()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await eventually(lambda: redis_server.ledger_state(namespace) == EMPTY)


async def test_polling_admits_waiters_when_wake_ups_are_off(make_ledger: MakeLedger) -> None:
    holder_worker = make_ledger(100)
    polling = make_ledger(100, notify=False, poll_interval=0.05)
    holder = await holder_worker.reserve(100)
    waiter = asyncio.ensure_future(polling.reserve(100))
    assert await still_waiting(waiter, settle=0.1)
    holder.release()
    (await asyncio.wait_for(waiter, 5)).release()


async def test_shrink_gives_bytes_to_a_waiter_of_another_worker(
    make_ledger: MakeLedger, redis_server: RedisServer, namespace: str
) -> None:
    first, second = make_ledger(100), make_ledger(100)
    big = await first.reserve(100)
    waiter = asyncio.ensure_future(second.reserve(40))
    await eventually(queued(redis_server, namespace, 1))
    assert big.shrink(60) == 40
    granted = await asyncio.wait_for(waiter, 5)
    assert redis_server.ledger_state(namespace)["reserved"] == 100
    big.shrink(70)  # growing is not shrinking: nothing changes
    assert big.nbytes == 60
    big.release()
    granted.release()
    await eventually(lambda: redis_server.ledger_state(namespace) == EMPTY)


async def test_a_shrink_lands_after_the_grows_made_before_it_whatever_the_lease(
    make_ledger: MakeLedger, redis_server: RedisServer, namespace: str
) -> None:
    """One process moves bytes from one lease to another (a grow, then a shrink: what vLLM's
    following does every reading). Each change is its own call to Redis; were the shrink to land
    first, another process's waiter would be granted the bytes the grow is about to take, and the
    budget over-committed (the two-process vLLM test saw it as a preemption)."""
    first, second = make_ledger(100), make_ledger(100)
    running, forecast = await first.reserve(60), await first.reserve(0)
    slow_grow = asyncio.Event()
    release = first._upkeep.scripts.release

    async def grow_slowly(id: str, keep: int, finished: bool) -> None:
        if id == forecast.id:
            await slow_grow.wait()
        await release(id, keep, finished)

    first._upkeep.scripts.release = grow_slowly  # type: ignore[method-assign]
    waiter = asyncio.ensure_future(second.reserve(50))
    await eventually(queued(redis_server, namespace, 1))
    forecast.grow(40)  # the grow first: the ledger never holds less than both sizes need
    running.shrink(20)
    assert await still_waiting(waiter, settle=0.5)  # the shrink has not freed anything yet
    assert redis_server.ledger_state(namespace)["reserved"] == 60
    slow_grow.set()
    await eventually(lambda: redis_server.ledger_state(namespace)["reserved"] == 60 and first.statistics().reserved_bytes == 60)
    assert await still_waiting(waiter, settle=0.3)  # 40 free, 50 asked
    running.release()
    (await asyncio.wait_for(waiter, 5)).release()
    forecast.release()
    await eventually(lambda: redis_server.ledger_state(namespace) == EMPTY)


async def test_statistics_and_retry_after_cover_every_worker(
    make_ledger: MakeLedger, redis_server: RedisServer, namespace: str
) -> None:
    clock = Clock()  # the ledgers' time (a drain rate needs a busy second); the waits are real
    first, second = make_ledger(100, clock=clock), make_ledger(100, clock=clock)
    mine, theirs = await first.reserve(30), await second.reserve(50)
    waiter = asyncio.ensure_future(second.reserve(60))
    await eventually(queued(redis_server, namespace, 1))
    stats = await first.refresh_statistics()
    assert (stats.reserved_bytes, stats.in_flight, stats.waiting, stats.waiting_bytes) == (80, 2, 1, 60)
    assert stats.admitted_total == 2 and stats.capacity_bytes == 100
    assert first.statistics() == stats  # the sync view is the last snapshot
    clock.advance(2)
    mine.release()
    theirs.release()
    (await asyncio.wait_for(waiter, 5)).release()
    await eventually(lambda: redis_server.ledger_state(namespace) == EMPTY)
    stats = await first.refresh_statistics()
    assert stats.release_rate_bytes_per_second > 0 and stats.admitted_total == 3
    assert 1.0 <= first.retry_after(100) < first.max_wait  # from the shared drain rate, not the fallback


async def test_retry_after_counts_the_same_bytes_ahead_as_the_in_process_ledger(
    make_ledger: MakeLedger, redis_server: RedisServer, namespace: str
) -> None:
    """Nine 100-byte waiters behind a 900-byte one: with max_bypass=8 the larger head claims
    before a new 100-byte request's turn, so 1,800 bytes are ahead of it (as in Ledger)."""
    clock = Clock()  # the ledger's time (a drain rate needs a busy second); the waits are real
    ledger = make_ledger(1000, max_bypass=8, clock=clock)
    for _ in range(3):  # a drain rate to predict from
        reservation = await ledger.reserve(100)
        clock.advance(1)
        reservation.release()
    holder = await ledger.reserve(1000)
    tasks = [asyncio.ensure_future(ledger.reserve(900))]
    await eventually(queued(redis_server, namespace, 1))
    tasks += [asyncio.ensure_future(ledger.reserve(100)) for _ in range(9)]
    await eventually(queued(redis_server, namespace, 10))
    stats = await ledger.refresh_statistics()
    rate = stats.release_rate_bytes_per_second
    assert rate > 0
    assert ledger.retry_after(100) == pytest.approx(min(600.0, max(1.0, (1800 + 100) / rate)))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    holder.release()
    await eventually(lambda: redis_server.ledger_state(namespace) == EMPTY)


async def test_the_middleware_admits_through_the_redis_ledger(redis_server: RedisServer, namespace: str) -> None:
    ledger = RedisLedger(redis_server.url, 100, namespace=namespace)
    peak = {"now": 0, "max": 0}

    @gpu_bound()
    async def generate(request: Request) -> JSONResponse:
        await request.body()  # admission happens at the first body read
        nbytes = (await gpu_reservation(request)).nbytes
        peak["now"] += nbytes
        peak["max"] = max(peak["max"], peak["now"])
        await asyncio.sleep(0.01)
        peak["now"] -= nbytes
        return JSONResponse({"bytes": nbytes})

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=1))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        sizes = [10, 30, 50, 70] * 5
        responses = await asyncio.gather(
            *(client.post("/generate", json={"prompt": "x", "max_new_tokens": n}) for n in sizes)
        )
    assert [r.status_code for r in responses] == [200] * len(sizes)
    assert 0 < peak["max"] <= 100
    await eventually(lambda: redis_server.ledger_state(namespace) == EMPTY)
    await ledger.aclose()


def test_ledger_from_url_selects_the_ledger(redis_server: RedisServer) -> None:
    assert isinstance(ledger_from_url(None, 100), Ledger)
    assert isinstance(ledger_from_url("memory://", 100, max_queue=3), Ledger)
    shared = ledger_from_url(redis_server.url, 100, max_queue=3, namespace="cfg", lease_ttl=2.0)
    assert isinstance(shared, RedisLedger)
    assert (shared.namespace, shared.max_queue, shared.lease_ttl) == ("cfg", 3, 2.0)
    with pytest.raises(ValueError, match="scheme"):
        ledger_from_url("postgres://x", 100)


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="local_share"):
        RedisLedger("redis://127.0.0.1:1", 100, on_unavailable="local")
    with pytest.raises(ValueError, match="heartbeat"):
        RedisLedger("redis://127.0.0.1:1", 100, lease_ttl=1.0, heartbeat=2.0)
    with pytest.raises(ValueError, match="max_connections"):
        RedisLedger("redis://127.0.0.1:1", 100, max_connections=1)
    with pytest.raises(ValueError, match="braces"):
        RedisLedger("redis://127.0.0.1:1", 100, namespace="{x}")


async def test_a_wait_for_a_pooled_connection_is_not_redis_being_down(
    redis_server: RedisServer, namespace: str
) -> None:
    # One connection for the scripts (the other is the wake-up subscription's) and a short
    # timeout: most of a burst waits longer than redis_timeout for the connection. That is a
    # burst, not an outage: nobody may get ledger-unavailable while Redis answers.
    # A max_wait far beyond the burst: on a loaded machine 600 calls through one connection take
    # longer than the default, and a queue timeout is not what this test is about.
    ledger = RedisLedger(
        redis_server.url, 10_000, namespace=namespace, max_connections=2, redis_timeout=0.1, max_wait=600
    )
    await ledger.refresh_statistics()
    try:
        outcomes = await asyncio.gather(*(ledger.reserve(1) for _ in range(600)), return_exceptions=True)
        assert [o for o in outcomes if not isinstance(o, Reservation)] == []
        assert ledger.available
        for reservation in outcomes:
            assert isinstance(reservation, Reservation)
            reservation.release()
        # 600 releases through the one connection: some may give up after their retries (as
        # documented), and then their leases expire: up to lease_ttl, and a heartbeat to reap them.
        await eventually(
            lambda: redis_server.ledger_state(namespace) == EMPTY, timeout=ledger.lease_ttl + 2 * ledger.heartbeat
        )
    finally:
        await ledger.aclose()


# -- the Retry-After of a refusal: from Redis's state at that instant, as in-process ------------

#: The drain rate's weighted busy seconds after 10 busy seconds (docs/admission.md, "Retry-After").
BUSY_10S = RATE_WINDOW * (1 - math.exp(-10 / RATE_WINDOW))


async def idle_tenant_behind_a_backlog(
    backend: Backend, **options: Any
) -> tuple[BudgetLedger, Reservation, list[asyncio.Task[Reservation]]]:
    """Tenant "d" (not configured) held 100 bytes for 10 s and went idle: a drain rate of 100 bytes
    per ``BUSY_10S`` weighted busy seconds, and d's virtual time 1,000. Then "x" holds the whole
    budget and queues four waiters of 20 bytes (x's virtual time 0: ahead of d). A request of d for
    20 bytes is therefore told (4 x 20 + 20) / (100 / BUSY_10S) = BUSY_10S s. The ledger, x's
    holder and x's waiters."""
    ledger = backend.make(100, max_wait=1000, **options)
    initial = ledger._upkeep.beat if isinstance(ledger, RedisLedger) else None
    reservation = await ledger.reserve(100, tenant="d")
    if isinstance(ledger, RedisLedger):
        # The heartbeat's first snapshot (taken as the first reserve starts it; the next is an
        # hour away) must land before d's release: a late one would not be the stale snapshot
        # the test means (a loaded machine delayed it past the release).
        await eventually(lambda: ledger._upkeep.beat is not initial)
    backend.clock.advance(10)
    reservation.release()
    if backend.server is not None:  # the release goes in the background: x must not queue behind d
        server, name = backend.server, ledger.namespace  # type: ignore[attr-defined]
        await eventually(lambda: server.ledger_state(name) == EMPTY)
    holder = await ledger.reserve(100, tenant="x")
    waiters = [start(ledger, 20, tenant="x") for _ in range(4)]
    await backend.queued(ledger, 4)
    return ledger, holder, waiters


async def refused(
    kind: str, server: RedisServer, name: str, snapshot: str, refusal: type[QueueFull | QueueTimeout]
) -> tuple[float, float | None]:
    """The ``Retry-After`` of d's refusal (``QueueFull``: the queue bound is x's four waiters;
    ``QueueTimeout``: d queues behind them and gives up after 0.2 s), and for Redis what its
    heartbeat snapshot would have said: one from before the backlog (``"stale"``: no drain rate
    yet, so ``max_wait``'s 600 s), or one refreshed just before (``"fresh"``: it has no row for
    the idle, unconfigured d, which then counts as a newcomer ordered first: 20 bytes' worth,
    ``BUSY_10S / 5`` s)."""
    async with open_ledgers(kind, clock=Clock(), server=server, name=name) as backend:
        options = {"max_queue": 4} if refusal is QueueFull else {}
        ledger, holder, waiters = await idle_tenant_behind_a_backlog(backend, **options)
        if snapshot == "fresh" and isinstance(ledger, RedisLedger):
            await ledger.refresh_statistics()
        # deadline=0.2 would be refused at once on the known drain rate (DeadlineUnmeetable): the
        # deprecated timeout= still waits without the deadline rule, as it did.
        with pytest.raises(refusal) as caught, pytest.warns(DeprecationWarning, match="deadline="):
            await asyncio.wait_for(ledger.reserve(20, tenant="d", timeout=0.2), 10)  # fail, never hang
        await backend.queued(ledger, 4)  # d's ticket, if it took one, is gone
        hint = ledger.retry_after(20, tenant="d") if isinstance(ledger, RedisLedger) else None
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        holder.release()
        assert caught.value.retry_after is not None
        return caught.value.retry_after, hint


@pytest.mark.parametrize("snapshot, snapshot_says", [("stale", 600.0), ("fresh", BUSY_10S / 5)])
@pytest.mark.parametrize("refusal", [QueueFull, QueueTimeout])
async def test_a_refusals_retry_after_is_the_in_process_ledgers_on_the_same_state(
    redis_server: RedisServer,
    namespace: str,
    snapshot: str,
    snapshot_says: float,
    refusal: type[QueueFull | QueueTimeout],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """queue-full and queue-timeout on Redis used to answer from the heartbeat snapshot (wrong
    both ways: 600 s or a fifth of the right answer); now from Redis's state when the script
    refused the request, or just after the timed-out waiter left the queue (as in-process: its own
    20 bytes no longer count, else 1.2 times the answer)."""
    monkeypatch.setattr("gpu_asgi._ledger.redis.ledger.TIMEOUT_STATE_WAIT", 10.0)  # however loaded the machine
    memory, _ = await refused("memory", redis_server, namespace, snapshot, refusal)
    shared, hint = await refused("redis", redis_server, namespace, snapshot, refusal)
    assert hint == pytest.approx(snapshot_says)  # what the old answer was
    assert memory == pytest.approx(BUSY_10S)
    assert shared == memory


@pytest.mark.parametrize("failure", ["down", "slow"])
async def test_a_redis_failure_at_the_timeout_still_answers_queue_timeout(
    make_ledger: MakeLedger, redis_server: RedisServer, namespace: str, failure: str
) -> None:
    """The read of Redis's state at the timeout fails (Redis refuses the call), or is slow (an
    answer only after 3 s, within ``redis_timeout``): the 503 queue-timeout goes out at once all
    the same, with the snapshot's finite Retry-After, and the queue is left in the background."""
    ledger = make_ledger(100, redis_timeout=30.0)
    holder = await ledger.reserve(100)
    scripts = ledger._scripts._scripts
    leave = scripts["leave"]

    async def fails_once(*args: Any, **options: Any) -> Any:
        scripts["leave"] = leave  # the retries in the background find Redis working again
        if failure == "down":
            raise RedisConnectionError("injected")
        await asyncio.sleep(3)
        return await leave(*args, **options)

    scripts["leave"] = fails_once  # type: ignore[assignment]
    begun = time.monotonic()
    with pytest.raises(QueueTimeout) as caught:
        await asyncio.wait_for(ledger.reserve(10, deadline=0.2), 10)  # fail, never hang
    assert time.monotonic() - begun < 2.5  # 0.2 s and TIMEOUT_STATE_WAIT, not the slow call's 3 s
    assert caught.value.retry_after is not None and 1 <= caught.value.retry_after <= 600
    assert scripts["leave"] is leave  # the failing call was made
    await eventually(queued(redis_server, namespace, 0))
    holder.release()
    await eventually(lambda: redis_server.ledger_state(namespace) == EMPTY)


async def test_a_tenant_at_its_own_queue_bound_is_told_so_as_in_process(
    redis_server: RedisServer, namespace: str
) -> None:
    """The reserve script says which bound refused the request: the same detail in both ledgers."""
    details = {}
    for kind in ("memory", "redis"):
        async with open_ledgers(kind, server=redis_server, name=namespace) as backend:
            ledger = backend.make(100, default_tenant_policy=TenantPolicy(max_queue=1))
            holder = await ledger.reserve(100, tenant="t")
            waiter = start(ledger, 10, tenant="t")
            await backend.queued(ledger, 1)
            with pytest.raises(QueueFull) as caught:
                await asyncio.wait_for(ledger.reserve(10, tenant="t"), 10)
            details[kind] = caught.value.detail
            holder.release()
            (await asyncio.wait_for(waiter, 5)).release()
    assert details == dict.fromkeys(
        ("memory", "redis"), "1 requests of this tenant are already waiting for GPU memory (its limit)."
    )


# -- the first ask is not cut short by the queue timeout -----------------------------------------


def slow_reserve_script(ledger: RedisLedger, seconds: float) -> None:
    """Every reserve script answers ``seconds`` late (a far Redis, a loaded one): longer than the
    timeouts the test gives, shorter than ``redis_timeout``."""
    scripts = ledger._scripts._scripts
    reserve = scripts["reserve"]

    async def slow(*args: Any, **options: Any) -> Any:
        await asyncio.sleep(seconds)
        return await reserve(*args, **options)

    scripts["reserve"] = slow  # type: ignore[assignment]


async def test_a_timeout_shorter_than_a_round_trip_still_grants_what_fits_at_once(
    make_ledger: MakeLedger, redis_server: RedisServer, namespace: str
) -> None:
    """As in-process (docs/admission.md, "Bounds"): a request that fits now is granted, and its
    timeout bounds the wait in the queue after the first ask, never the first ask's round trip."""
    ledger = make_ledger(100)
    slow_reserve_script(ledger, 0.2)
    granted = [await asyncio.wait_for(ledger.reserve(10), 10)]
    # The middleware's call for x-request-timeout: 0.001 (the deadline takes the same first ask).
    granted.append(await asyncio.wait_for(ledger.reserve(10, deadline=0.001), 10))
    assert [reservation.nbytes for reservation in granted] == [10, 10]
    granted.append(await ledger.reserve(80))  # the budget is full now
    # One that must queue still times out, counted from when it joined the queue.
    begun = time.monotonic()
    with pytest.raises(QueueTimeout):
        await asyncio.wait_for(ledger.reserve(10, deadline=0.05), 10)  # fail, never hang (no drain rate yet)
    assert time.monotonic() - begun >= 0.2 + 0.05  # the slow first ask, then the whole timeout
    await eventually(queued(redis_server, namespace, 0))
    for reservation in granted:
        reservation.release()
    await eventually(lambda: redis_server.ledger_state(namespace) == EMPTY)
