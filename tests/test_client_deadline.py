"""Deadline-aware admission: ``x-request-timeout`` and a route's ``deadline`` (docs/admission.md,
"Deadlines"). A request that would queue longer than it is willing to wait is refused at once;
otherwise it queues with its own, shorter timeout. Both ledgers decide alike."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gpu_asgi import (
    BudgetLedger,
    DeadlineUnmeetable,
    GPUAdmissionMiddleware,
    GPUMetrics,
    Ledger,
    Reservation,
    RouteSpec,
    TenantPolicy,
    gpu_bound,
)
from gpu_asgi._ledger.drain import RATE_WINDOW

from . import _redis
from ._asgi import client, wait_until
from ._backends import BACKENDS, Backend, Clock, heavy_backlog, open_backend, recording, start
from ._redis import REDIS_SERVER, RedisServer

redis_server, namespace = _redis.redis_server, _redis.namespace  # fixtures

CAPACITY = 100_000
NEED = 50_000  # what every request here asks for


class Fixed:
    """An estimator that asks for ``NEED`` bytes whatever the request."""

    def estimate(self, prompt_tokens: int, max_new_tokens: int, batch: int = 1, *, sampling: bool | None = None) -> int:
        return NEED


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def app_for(ledger: BudgetLedger, reject_status: int = 503, metrics: GPUMetrics | None = None, **route: Any) -> Starlette:
    @gpu_bound(**route)
    async def generate(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=Fixed(), reject_status=reject_status, metrics=metrics)
    return app


async def post(app: Starlette, timeout: str | bytes | None = None) -> httpx.Response:
    headers = {} if timeout is None else {"x-request-timeout": timeout}
    async with client(app) as http:
        return await http.post("/generate", json={"prompt": "hi"}, headers=headers)


# -- the header ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", ["0", "0.0", "-1", "nan", "inf", "soon", "", "1e999", " 5", "1_0", "١".encode(), "9" * 400, "1" * 400 + ".5"]
)
async def test_an_invalid_header_is_a_400_naming_it(value: str | bytes) -> None:
    ledger = Ledger(CAPACITY)
    response = await post(app_for(ledger), value)
    assert response.status_code == 400
    problem = response.json()
    assert problem["type"].endswith(":invalid-header") and "x-request-timeout" in problem["detail"]
    assert problem["header"] == "x-request-timeout"
    assert ledger.statistics().admitted_total == 0


@pytest.mark.parametrize("value", ["0.5", "3", "2.", ".25"])
async def test_a_valid_header_admits_at_once_when_the_bytes_fit(value: str) -> None:
    ledger = Ledger(CAPACITY)
    timeouts = recording(ledger)
    assert (await post(app_for(ledger), value)).status_code == 200
    assert timeouts == []  # admitted by try_reserve: the queue path never ran


async def full_ledger_with_a_drain_rate() -> tuple[Ledger, Reservation]:
    """An in-process ledger that has seen 10,000 bytes per busy second, now full."""
    clock = FakeClock()
    ledger = Ledger(CAPACITY, clock=clock, max_wait=30)
    for _ in range(10):
        reservation = await ledger.reserve(10_000)
        clock.now += 1
        reservation.release()
    return ledger, await ledger.reserve(CAPACITY)  # NEED bytes now wait 50,000 / 10,000 = 5 s


@pytest.mark.parametrize(
    ("header", "route", "expected"),
    [
        ("12", {}, 12.0),  # under the ledger's max_wait (30)
        ("100", {}, 30.0),  # capped by max_wait
        ("12", {"deadline": 8.0}, 8.0),  # capped by the route
        (None, {"deadline": 8.0}, 8.0),  # the route's own deadline
        (None, {}, None),  # no deadline: the ledger's max_wait, as before
    ],
)
async def test_a_queued_request_waits_with_its_own_timeout(
    header: str | None, route: dict[str, Any], expected: float | None
) -> None:
    ledger, holder = await full_ledger_with_a_drain_rate()
    timeouts = recording(ledger)
    request = asyncio.ensure_future(post(app_for(ledger, **route), header))
    await wait_until(lambda: ledger.statistics().waiting == 1)
    holder.release()
    assert (await request).status_code == 200
    assert timeouts == [expected]


# -- the decision ----------------------------------------------------------------------------


@pytest.mark.parametrize("reject_status", [503, 429])
async def test_a_predicted_wait_over_the_deadline_is_refused_at_once(reject_status: int) -> None:
    ledger, holder = await full_ledger_with_a_drain_rate()
    timeouts = recording(ledger)
    response = await post(app_for(ledger, reject_status=reject_status), "2")
    assert response.status_code == reject_status
    assert response.json()["type"].endswith(":deadline-unmeetable")
    assert response.headers["retry-after"] == "5"  # the same model as any other Retry-After
    assert timeouts == [2.0] and ledger.statistics().waiting == 0  # reserve() refused it before it queued
    assert ledger.statistics().rejected_total == {"deadline-unmeetable": 1}  # the ledger counts it, as /health shows
    holder.release()


async def test_the_route_deadline_refuses_without_a_header() -> None:
    ledger, holder = await full_ledger_with_a_drain_rate()
    response = await post(app_for(ledger, deadline=2.0))
    assert response.status_code == 503 and response.json()["type"].endswith(":deadline-unmeetable")
    holder.release()


async def test_only_the_max_wait_fallback_never_refuses() -> None:
    """Before any release the hint is max_wait (30 s), not a prediction: the request queues."""
    ledger = Ledger(CAPACITY, max_wait=30)
    holder = await ledger.reserve(CAPACITY)
    assert ledger.retry_after(NEED) == 30
    timeouts = recording(ledger)
    request = asyncio.ensure_future(post(app_for(ledger), "2"))
    await wait_until(lambda: ledger.statistics().waiting == 1)
    holder.release()
    assert (await request).status_code == 200 and timeouts == [2.0]


async def test_both_refusals_are_counted_by_reason() -> None:
    ledger, holder = await full_ledger_with_a_drain_rate()
    registry = CollectorRegistry()
    app = app_for(ledger, metrics=GPUMetrics(ledger, registry=registry, multiprocess=False))
    assert (await post(app, "2")).status_code == 503
    assert (await post(app, "soon")).status_code == 400
    for reason in ("deadline-unmeetable", "invalid-header"):
        assert registry.get_sample_value("gpu_asgi_rejected_total", {"reason": reason}) == 1
    holder.release()


def test_a_route_deadline_must_be_positive_and_finite() -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="deadline"):
            RouteSpec(deadline=bad)
    assert DeadlineUnmeetable.status == 503


async def test_max_client_wait_is_the_deprecated_name_of_the_route_deadline() -> None:
    with pytest.warns(DeprecationWarning, match="deadline="):
        spec = RouteSpec(max_client_wait=8.0)
    assert spec.deadline == 8.0 and spec.max_client_wait == 8.0
    with pytest.raises(TypeError, match="deadline= alone"), pytest.warns(DeprecationWarning):
        RouteSpec(deadline=1.0, max_client_wait=8.0)
    ledger, holder = await full_ledger_with_a_drain_rate()
    with pytest.warns(DeprecationWarning, match="max_client_wait"):
        app = app_for(ledger, max_client_wait=2.0)
    response = await post(app)  # the old name still refuses what its deadline cannot meet
    assert response.status_code == 503 and response.json()["type"].endswith(":deadline-unmeetable")
    holder.release()


# -- the same decision with the Redis ledger ----------------------------------------------------------


@pytest.fixture
async def redis_ledger(redis_server: RedisServer, namespace: str) -> AsyncIterator[Callable[..., BudgetLedger]]:
    from gpu_asgi._ledger.redis.ledger import RedisLedger

    from ._redis_clock import redis_ledger as clocked_ledger

    made: list[RedisLedger] = []

    def make(**options: Any) -> RedisLedger:
        made.append(clocked_ledger(redis_server.url, CAPACITY, namespace=namespace, **options))
        return made[-1]

    yield make
    for ledger in made:
        await ledger.aclose()


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not on PATH")
async def test_the_redis_ledger_decides_the_same(redis_ledger: Callable[..., Any]) -> None:
    clock = Clock()  # the ledger's time; the waits below are real
    ledger = redis_ledger(max_wait=1000, clock=clock)
    # 10,000 bytes released after 2 s of busy time (a rate needs a busy second): about 5,200 bytes
    # per second, so NEED bytes behind a full budget are predicted to wait about 9.7 s.
    reservation = await ledger.reserve(10_000)
    clock.advance(2)
    reservation.release()
    holder = await ledger.reserve(CAPACITY)
    stats = await ledger.refresh_statistics()
    assert stats.release_rate_bytes_per_second > 0 and stats.reserved_bytes == CAPACITY
    assert 5 <= ledger.retry_after(NEED) <= 600

    refused = await post(app_for(ledger), "2")
    assert refused.status_code == 503 and refused.json()["type"].endswith(":deadline-unmeetable")
    assert int(refused.headers["retry-after"]) >= 5

    timeouts = recording(ledger)
    request = asyncio.ensure_future(post(app_for(ledger), "900"))  # over any prediction: it queues
    await wait_until(lambda: len(timeouts) == 1)
    await asyncio.sleep(0.2)
    assert not request.done()
    holder.release()
    assert (await asyncio.wait_for(request, 30)).status_code == 200
    assert timeouts == [900.0]


# -- the Redis ledger decides on the state of the moment, not on its snapshot ------------------------
#
# A heartbeat of half an hour: the snapshot behind statistics() and retry_after() stays as the
# test left it, however slow the machine.
STALE = {"max_wait": 1000, "lease_ttl": 3600.0, "heartbeat": 1800.0}


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not on PATH")
async def test_a_request_redis_can_grant_now_is_admitted_whatever_the_snapshot_says(
    redis_ledger: Callable[..., Any], redis_server: RedisServer, namespace: str
) -> None:
    ledger = redis_ledger(**STALE)
    (await ledger.reserve(10_000)).release()
    holder = await ledger.reserve(CAPACITY)
    stats = await ledger.refresh_statistics()
    assert stats.reserved_bytes == CAPACITY and ledger.retry_after(NEED) >= 5  # the snapshot: full, 5 s or more
    holder.release()
    await _redis.eventually(lambda: redis_server.ledger_state(namespace)["reserved"] == 0)
    assert ledger.statistics().reserved_bytes == CAPACITY  # still what the snapshot says

    response = await post(app_for(ledger), "2")
    assert response.status_code == 200  # granted at once: Redis is free now


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not on PATH")
async def test_the_redis_decision_uses_the_state_when_the_request_must_queue(
    redis_ledger: Callable[..., Any], redis_server: RedisServer, namespace: str
) -> None:
    """The snapshot says the budget is free; another worker has since taken all of it: the
    request is refused at once, from Redis's state, and leaves no ticket behind."""
    clock = Clock()  # a rate needs a busy second
    ledger, other = redis_ledger(**STALE, clock=clock), redis_ledger(**STALE, clock=clock)
    reservation = await ledger.reserve(10_000)
    clock.advance(2)
    reservation.release()
    await _redis.eventually(lambda: redis_server.ledger_state(namespace)["reserved"] == 0)
    stats = await ledger.refresh_statistics()
    assert stats.reserved_bytes == 0 and stats.release_rate_bytes_per_second > 0
    assert ledger.retry_after(NEED) == 1  # from the snapshot: it would fit
    holder = await other.reserve(CAPACITY)

    response = await post(app_for(ledger), "2")
    assert response.status_code == 503 and response.json()["type"].endswith(":deadline-unmeetable")
    assert int(response.headers["retry-after"]) >= 5  # NEED bytes behind a full budget at about 5,200 B/s
    assert redis_server.ledger_state(namespace)["tickets"] == 0  # it never joined the queue
    holder.release()


# -- both ledgers: one rule, on the same state, the same prediction ------------------------------


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    async with open_backend(request, clock=Clock()) as opened:
        yield opened


def waiting_now(backend: Backend, ledger: BudgetLedger) -> int:
    """Waiters in the ledger at this instant (no polling: a ticket that came and went is not missed)."""
    if backend.kind == "memory":
        return ledger.statistics().waiting
    assert backend.server is not None
    return int(backend.server.ledger_state(ledger.namespace)["tickets"])  # type: ignore[attr-defined, call-overload]


def reserved_now(backend: Backend, ledger: BudgetLedger) -> int:
    if backend.kind == "memory":
        return ledger.statistics().reserved_bytes
    assert backend.server is not None
    return int(backend.server.ledger_state(ledger.namespace)["reserved"])  # type: ignore[attr-defined, call-overload]


async def test_a_request_that_must_queue_is_decided_on_the_state_of_that_moment(backend: Backend) -> None:
    """A drain rate of 10 bytes per busy second, 100 bytes held by "heavy" and four heavy
    waiters of 20 bytes: a heavy request is predicted (4 x 20 + 20) / 10 = 10 s and refused with
    a limit of 5 s, without joining the queue; a light one, ordered before the heavy backlog, is
    predicted 20 / 10 = 2 s and queues. Both ledgers predict the same."""
    ledger = backend.make(100, max_wait=1000)
    holder, heavy = await heavy_backlog(backend, ledger, then=0)
    refresh = getattr(ledger, "refresh_statistics", None)
    stats = await refresh() if refresh is not None else ledger.statistics()
    rate = stats.release_rate_bytes_per_second
    assert 5 < rate < 20  # neither prediction below is clamped
    expected = ledger.retry_after(20, tenant="heavy")
    assert expected == pytest.approx(100 / rate)

    with pytest.raises(DeadlineUnmeetable) as refused:
        await asyncio.wait_for(ledger.reserve(20, tenant="heavy", deadline=5), 10)  # fail, never hang
    assert refused.value.retry_after == expected
    assert refused.value.extensions == {"predicted_wait_seconds": round(expected, 3)}
    assert waiting_now(backend, ledger) == 4  # never queued, not even for a moment

    light = start(ledger, 20, tenant="light", deadline=5)
    await backend.queued(ledger, 5)
    holder.release()
    assert (await asyncio.wait_for(light, 5)).tenant == "light"  # ordered before the heavy backlog
    for task in heavy:
        task.cancel()
    await asyncio.gather(*heavy, return_exceptions=True)


async def test_a_deadline_refusal_is_counted_as_the_ledgers_other_refusals_are(backend: Backend) -> None:
    """``statistics().rejected_total`` (what /health shows) counts ``deadline-unmeetable`` in both
    ledgers, as it counts ``queue-full`` and the rest; it used to miss it in both."""
    ledger = backend.make(100, max_wait=1000)
    holder, heavy = await heavy_backlog(backend, ledger, then=0)
    for _ in range(2):
        with pytest.raises(DeadlineUnmeetable):
            await asyncio.wait_for(ledger.reserve(20, tenant="heavy", deadline=5), 10)  # fail, never hang
    for task in heavy:  # cancelled: no refusal
        task.cancel()
    await asyncio.gather(*heavy, return_exceptions=True)
    holder.release()
    expected = {"deadline-unmeetable": 2}
    refresh = getattr(ledger, "refresh_statistics", None)
    if refresh is None:
        assert ledger.statistics().rejected_total == expected
        return
    counted: dict[str, int] = {}
    for _ in range(100):  # Redis counts in the background, best effort: until both have landed
        counted = dict((await refresh()).rejected_total)
        if counted == expected:
            break
        await asyncio.sleep(0.05)
    assert counted == expected


async def test_an_idle_tenant_is_ordered_by_its_remembered_virtual_time(backend: Backend) -> None:
    """Tenant "d" (no configured policy) held 100 bytes for 10 s and went idle: it is remembered
    with that virtual time (1,000), above the backlogged "x" (0), so "x"'s four waiters are ahead
    of it and it is predicted (4 x 20 + 20) bytes over 100 bytes per 10 busy seconds (8.5
    weighted, ``_drain``) = 8.5 s: refused with a limit of 5 s. The Redis
    ledger's decision reads the arriving tenant's account too, not only the active ones' (a
    tenant that is neither active nor configured would otherwise count as new: 2 s, queued)."""
    ledger = backend.make(100, max_wait=1000)
    reservation = await ledger.reserve(100, tenant="d")
    backend.clock.advance(10)
    reservation.release()
    if backend.kind == "redis":  # the release goes in the background: "x" must not queue behind "d"
        await _redis.eventually(lambda: waiting_now(backend, ledger) == 0 and reserved_now(backend, ledger) == 0)
    holder = await ledger.reserve(100, tenant="x")
    waiters = [start(ledger, 20, tenant="x") for _ in range(4)]
    await backend.queued(ledger, 4)
    with pytest.raises(DeadlineUnmeetable) as refused:
        await asyncio.wait_for(ledger.reserve(20, tenant="d", deadline=5), 10)  # fail, never hang
    assert refused.value.retry_after == pytest.approx(RATE_WINDOW * -math.expm1(-10 / RATE_WINDOW))
    assert waiting_now(backend, ledger) == 4
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    holder.release()


async def test_without_a_drain_rate_nothing_is_refused(backend: Backend) -> None:
    ledger = backend.make(100, max_wait=1000)
    holder = await ledger.reserve(100)
    waiter = start(ledger, 50, deadline=3)  # short, but no drain rate is known
    await backend.queued(ledger, 1)
    holder.release()
    (await asyncio.wait_for(waiter, 5)).release()


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not on PATH")
async def test_bytes_freed_between_the_decision_and_joining_are_granted(
    redis_ledger: Callable[..., Any], redis_server: RedisServer, namespace: str
) -> None:
    """Not refused, the request asks again to join; the budget freed meanwhile: it is granted
    then, and no ticket is left behind."""
    from gpu_asgi._ledger.redis.scripts import Beat

    ledger = redis_ledger(**STALE)
    (await ledger.reserve(10_000)).release()
    holder = await ledger.reserve(CAPACITY)
    answers: list[str] = []
    reserve = ledger._scripts.reserve

    async def freed_after_the_decision(*args: Any, **options: Any) -> Any:
        answer = await reserve(*args, **options)
        answers.append("state" if isinstance(answer, Beat) else answer[0])
        if isinstance(answer, Beat):
            holder.release()
            await _redis.eventually(lambda: redis_server.ledger_state(namespace)["reserved"] == 0)
        return answer

    ledger._scripts.reserve = freed_after_the_decision
    reservation = await asyncio.wait_for(ledger.reserve(NEED, deadline=900), 10)
    assert answers == ["state", "granted"]
    assert redis_server.ledger_state(namespace) == {"reserved": NEED, "leases": 1, "tickets": 0, "queued": 0}
    reservation.release()


# -- a tenant at its quota waits for its own bytes (docs/admission.md, "Retry-After with quotas") ---

#: Busy seconds, weighted as the drain rate weighs them (``_drain``), of the 10 s the scenarios wait.
TEN_SECONDS = RATE_WINDOW * -math.expm1(-10 / RATE_WINDOW)


async def refreshed(ledger: BudgetLedger) -> float:
    """The ledger's release rate, after a fresh snapshot (the Redis ledger's ``retry_after()`` reads it)."""
    refresh = getattr(ledger, "refresh_statistics", None)
    stats = await refresh() if refresh is not None else ledger.statistics()
    return stats.release_rate_bytes_per_second


async def capped_at_its_quota_with_its_own_rate(backend: Backend) -> tuple[BudgetLedger, Reservation]:
    """A budget of 1,000 bytes; "capped" (quota 100) held 100 while its next 100 waited 10 s,
    then was admitted as its first came back, while "warm" gave back 900: "capped"'s own bytes
    come back at 100 per 10 waiting seconds, the device's at ten times that. Now "capped" holds
    its whole quota on a device 90 % free, and nobody waits."""
    ledger = backend.make(1000, tenants={"capped": TenantPolicy(quota_bytes=100)}, max_wait=1000)
    warm = await ledger.reserve(900, tenant="warm")
    first = await ledger.reserve(100, tenant="capped")
    second = start(ledger, 100, tenant="capped")
    await backend.queued(ledger, 1)
    backend.clock.advance(10)
    warm.release()
    first.release()
    holder = await asyncio.wait_for(second, 5)
    await _redis.eventually(lambda: reserved_now(backend, ledger) == 100 and waiting_now(backend, ledger) == 0)
    return ledger, holder


async def test_a_tenant_at_its_quota_is_told_the_wait_for_its_own_bytes(backend: Backend) -> None:
    """50 more bytes for "capped" need 50 of its own bytes back, at its own rate of 100 per
    10 waiting seconds: about 4.3 s, not the 1 s that the device's 900 free bytes suggest (nor
    the 0.43 s the device's rate would give); both ledgers alike, the Redis ledger's
    ``retry_after()`` from its heartbeat."""
    ledger, holder = await capped_at_its_quota_with_its_own_rate(backend)
    assert await refreshed(ledger) == pytest.approx(1000 / TEN_SECONDS)
    assert ledger.retry_after(50, tenant="capped") == pytest.approx(50 / (100 / TEN_SECONDS))
    assert ledger.retry_after(50, tenant="capped") == pytest.approx(4.252, abs=1e-3)
    holder.release()


async def test_a_deadline_shorter_than_the_quota_wait_is_refused_and_a_longer_one_queues(backend: Backend) -> None:
    ledger, holder = await capped_at_its_quota_with_its_own_rate(backend)
    expected = 50 / (100 / TEN_SECONDS)
    with pytest.raises(DeadlineUnmeetable) as refused:
        await asyncio.wait_for(ledger.reserve(50, tenant="capped", deadline=2), 10)  # fail, never hang
    assert refused.value.retry_after == pytest.approx(expected)
    assert refused.value.extensions == {"predicted_wait_seconds": round(refused.value.retry_after, 3)}
    assert waiting_now(backend, ledger) == 0  # never queued

    waiter = start(ledger, 50, tenant="capped", deadline=10)
    await backend.queued(ledger, 1)
    assert not waiter.done()  # 900 bytes free, but the quota is full: it waits for "capped"'s own bytes
    holder.release()
    (await asyncio.wait_for(waiter, 5)).release()


async def test_a_tenant_with_no_rate_of_its_own_is_told_the_wait_at_the_ledgers_release_rate(backend: Backend) -> None:
    """QA's case: "capped" never waited, so its own rate is unknown; its 50 bytes are predicted
    at the ledger's release rate (100 bytes per 10 busy seconds), not the 1 s floor: a deadline
    of 2 s is refused at once, one of 10 s queues."""
    ledger = backend.make(1000, tenants={"capped": TenantPolicy(quota_bytes=100)}, max_wait=1000)
    warm = await ledger.reserve(100, tenant="warm")
    backend.clock.advance(10)
    warm.release()
    await _redis.eventually(lambda: reserved_now(backend, ledger) == 0)
    holder = await ledger.reserve(100, tenant="capped")
    rate = await refreshed(ledger)
    assert rate == pytest.approx(100 / TEN_SECONDS)
    assert ledger.retry_after(50, tenant="capped") == pytest.approx(50 / rate)
    with pytest.raises(DeadlineUnmeetable) as refused:
        await asyncio.wait_for(ledger.reserve(50, tenant="capped", deadline=2), 10)  # fail, never hang
    assert refused.value.retry_after == pytest.approx(50 / rate)
    waiter = start(ledger, 50, tenant="capped", deadline=10)
    await backend.queued(ledger, 1)
    holder.release()
    (await asyncio.wait_for(waiter, 5)).release()


@pytest.mark.parametrize("quota", [None, 200, 1000])
async def test_a_tenant_without_a_quota_or_within_it_is_predicted_as_before(backend: Backend, quota: int | None) -> None:
    """The heavy backlog (100 bytes held, four waiters of 20, 10 bytes per busy second): a heavy
    request of 20 is predicted (4 x 20 + 20) / rate, with no quota or one it stays within (200:
    100 held + 80 ahead + 20 exactly fill it), and a light one 20 / rate; the quota term adds
    nothing where it does not bind."""
    tenants = {} if quota is None else {"heavy": TenantPolicy(quota_bytes=quota)}
    ledger = backend.make(100, max_wait=1000, tenants=tenants)
    holder, heavy = await heavy_backlog(backend, ledger, then=0)
    rate = await refreshed(ledger)
    assert ledger.retry_after(20, tenant="heavy") == pytest.approx(100 / rate)
    assert ledger.retry_after(20, tenant="light") == pytest.approx(20 / rate)
    with pytest.raises(DeadlineUnmeetable) as refused:
        await asyncio.wait_for(ledger.reserve(20, tenant="heavy", deadline=5), 10)  # fail, never hang
    assert refused.value.retry_after == pytest.approx(100 / rate)
    for task in heavy:
        task.cancel()
    await asyncio.gather(*heavy, return_exceptions=True)
    holder.release()
