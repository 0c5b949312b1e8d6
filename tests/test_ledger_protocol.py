"""The BudgetLedger protocol as users meet it: a ledger of their own (today's shape, and the shape
an earlier release documented), ``ledger_from_url`` handing one configuration to both backends,
and the Redis ledger's scripts as shipped (package data, one text everywhere, no test hook)."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import subprocess
import sys
import warnings
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gpu_asgi import (
    BudgetLedger,
    DeviceStatistics,
    GPUAdmissionMiddleware,
    Ledger,
    LedgerStatistics,
    LinearEstimator,
    OverTenantQuota,
    QueueTimeout,
    Reservation,
    TenantPolicy,
    gpu_bound,
    health_report,
    ledger_from_url,
)
from gpu_asgi._ledger.legacy import LegacyLedger, as_budget_ledger
from gpu_asgi._ledger.tenants import DEFAULT_TENANT

from . import _redis
from ._asgi import client, wait_until
from ._redis import RedisServer, requires_redis_server

redis_server, namespace = _redis.redis_server, _redis.namespace  # fixtures


class OldShapeLedger:
    """A user's ledger written to the protocol as an earlier release documented it: synchronous
    ``try_reserve``, ``reserve(timeout=, wait_limit=)``, a private ``_give_back``, and none of
    ``max_wait``, ``max_queue``, ``tenants``, ``availability``. One device, polled every 10 ms."""

    devices = ("cuda:0",)

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.reserved = 0
        self.admitted = 0
        self.waiting = 0
        self.asked: list[tuple[float | None, float | None]] = []  # (timeout, wait_limit) of each reserve()

    def try_reserve(
        self, nbytes: int, *, devices: Sequence[str] | None = None, tenant: str = DEFAULT_TENANT
    ) -> Reservation | None:
        if self.reserved + nbytes > self.capacity:
            return None
        self.reserved += nbytes
        self.admitted += 1
        return Reservation(self, f"r{self.admitted}", "cuda:0", nbytes, 0.0, tenant)  # type: ignore[arg-type]

    async def reserve(
        self,
        nbytes: int,
        *,
        devices: Sequence[str] | None = None,
        priority: int = 0,
        timeout: float | None = None,
        tenant: str = DEFAULT_TENANT,
        wait_limit: float | None = None,
    ) -> Reservation:
        self.asked.append((timeout, wait_limit))
        self.waiting += 1
        try:
            async with asyncio.timeout(timeout):
                while (reservation := self.try_reserve(nbytes, tenant=tenant)) is None:
                    await asyncio.sleep(0.01)
        except TimeoutError:
            raise QueueTimeout("no room in time", retry_after=1.0) from None
        finally:
            self.waiting -= 1
        return reservation

    def retry_after(self, nbytes: int = 0, *, priority: int = 0, tenant: str = DEFAULT_TENANT) -> float:
        return 1.0

    def tenant_policy(self, tenant: str) -> TenantPolicy:
        return TenantPolicy()

    def statistics(self) -> LedgerStatistics:
        device = DeviceStatistics("cuda:0", self.capacity, self.reserved, 1 if self.reserved else 0)
        return LedgerStatistics((device,), self.waiting, 0, self.admitted)

    def _give_back(self, reservation: Reservation, nbytes: int, *, finished: bool) -> None:
        self.reserved -= nbytes


def app_for(ledger: Any, held: list[int]) -> Starlette:
    @gpu_bound()
    async def generate(request: Request) -> JSONResponse:
        await request.body()
        held.append(ledger.reserved)  # the bytes are held while the endpoint runs
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=1))
    return app


async def test_a_ledger_in_the_old_shape_still_admits_queues_and_releases_through_the_middleware() -> None:
    """Issue 21 item 4: a user's ledger of the first documented shape is adapted once, with a
    DeprecationWarning, and works: admitted at once, queued with its deadline as the old
    ``timeout``/``wait_limit`` pair, every byte given back through its ``_give_back``."""
    ledger = OldShapeLedger(1000)
    held: list[int] = []
    with pytest.warns(DeprecationWarning, match="earlier release"):
        app = app_for(ledger, held)
        app.middleware_stack = app.build_middleware_stack()
    async with client(app) as http:
        with pytest.warns(DeprecationWarning, match="_give_back"):
            response = await http.post("/generate", json={"prompt": "hello there", "max_new_tokens": 4})
        assert response.status_code == 200 and held[0] > 0 and ledger.reserved == 0
        assert ledger.asked == []  # it fit: try_reserve admitted it, no reserve() call

        blocker = ledger.try_reserve(1000)
        assert blocker is not None
        request = asyncio.ensure_future(
            http.post("/generate", json={"prompt": "hi", "max_new_tokens": 4}, headers={"x-request-timeout": "5"})
        )
        await wait_until(lambda: ledger.waiting == 1)
        blocker.release()
        assert (await request).status_code == 200
    assert ledger.asked == [(5.0, 5.0)]  # the deadline, as the old pair (no max_wait: no cap)
    assert ledger.reserved == 0 and held[1] > 0
    with pytest.warns(DeprecationWarning):
        assert health_report(ledger)["status"] == "ok"  # /health reads it through the same adapter


def test_the_adapter_reports_what_an_old_ledger_lacks_as_the_middleware_assumed_then() -> None:
    with pytest.warns(DeprecationWarning):
        adapted = as_budget_ledger(OldShapeLedger(10))
    assert isinstance(adapted, LegacyLedger) and isinstance(adapted, BudgetLedger)
    assert adapted.max_wait == float("inf") and adapted.tenants == {} and adapted.availability == "available"
    assert adapted.max_queue >= 2**31  # no bound of its own: /health never calls its queue full


def test_a_ledger_in_todays_shape_is_used_as_it_is() -> None:
    ledger = Ledger(100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert as_budget_ledger(ledger) is ledger
        assert GPUAdmissionMiddleware(Starlette(), ledger=ledger, estimator=LinearEstimator(1)).ledger is ledger


class WithoutAclose:
    """A user's ledger in the shape of the release before ``aclose`` joined the protocol: every
    other member, each an in-process ledger's."""

    def __init__(self, inner: Ledger) -> None:
        self.inner = inner
        self.devices, self.max_queue, self.max_wait = inner.devices, inner.max_queue, inner.max_wait
        self.tenants, self.availability = inner.tenants, inner.availability
        self.reserve_if_free, self.reserve, self.give_back = inner.reserve_if_free, inner.reserve, inner.give_back
        self.retry_after, self.tenant_policy, self.statistics = inner.retry_after, inner.tenant_policy, inner.statistics


class ClosingOldShapeLedger(OldShapeLedger):
    closed = False

    async def aclose(self) -> None:
        self.closed = True


async def test_a_ledger_without_aclose_is_adapted_and_closing_it_does_nothing() -> None:
    ledger = WithoutAclose(Ledger(100))
    assert not isinstance(ledger, BudgetLedger)
    with pytest.warns(DeprecationWarning, match=r"it lacks aclose\)"):
        adapted = as_budget_ledger(ledger)
    assert isinstance(adapted, LegacyLedger)
    (await adapted.reserve(40, deadline=1.0)).release()
    await adapted.aclose()
    assert ledger.inner.statistics().reserved_bytes == 0
    with pytest.warns(DeprecationWarning):
        old = as_budget_ledger(ClosingOldShapeLedger(10))
    await old.aclose()  # an old ledger's own aclose, where it has one
    assert isinstance(old, LegacyLedger) and old.ledger.closed


def test_the_protocol_has_no_private_member_and_one_deadline() -> None:
    members = {
        name
        for name, value in vars(BudgetLedger).items()
        if (callable(value) or isinstance(value, property)) and not name.startswith("__")
    }
    assert not [name for name in members if name.startswith("_")], members
    assert {"max_wait", "max_queue", "tenants", "availability", "give_back", "reserve_if_free", "aclose"} <= members
    reserve = inspect.signature(BudgetLedger.reserve).parameters
    assert "deadline" in reserve and "timeout" not in reserve and "wait_limit" not in reserve


# -- ledger_from_url: one configuration, one behaviour ---------------------------------------------

SHARED_OPTIONS: dict[str, Any] = {
    "max_queue": 7,
    "max_wait": 12.0,
    "max_bypass": 3,
    "tenants": {"gold": TenantPolicy(weight=3.0, quota_bytes=60, max_queue=2)},
    "default_tenant_policy": TenantPolicy(weight=0.5),
    "tenant_idle_ttl": 42.0,
}


@pytest.fixture
async def both(redis_server: RedisServer, namespace: str) -> AsyncIterator[tuple[BudgetLedger, BudgetLedger]]:
    memory = ledger_from_url("memory://", 100, namespace=namespace, **SHARED_OPTIONS)
    shared = ledger_from_url(redis_server.url, 100, namespace=namespace, **SHARED_OPTIONS)
    yield memory, shared
    await shared.aclose()  # type: ignore[attr-defined]


@requires_redis_server
async def test_ledger_from_url_gives_both_backends_every_shared_option(both: tuple[Any, Any]) -> None:
    """Issue 21 item 3: the tenant options reached only the Redis ledger; memory:// dropped them."""
    memory, shared = both
    for name in SHARED_OPTIONS:
        assert getattr(memory, name) == getattr(shared, name) == SHARED_OPTIONS[name], name
    for tenant in ("gold", "anyone"):
        assert memory.tenant_policy(tenant) == shared.tenant_policy(tenant)
    for ledger in (memory, shared):
        with pytest.raises(OverTenantQuota):
            await ledger.reserve(61, tenant="gold")
        (await ledger.reserve(40, tenant="gold")).release()
    for _ in range(250):  # the Redis ledger's release lands in the background
        theirs = await shared.refresh_statistics()
        if theirs.reserved_bytes == 0:
            break
        await asyncio.sleep(0.02)
    mine = memory.statistics()

    def policies(stats: LedgerStatistics) -> list[tuple[str, float, int | None, int, int]]:
        # served byte-seconds left out: they count real seconds, which differ between the two runs
        return [(t.name, t.weight, t.quota_bytes, t.reserved_bytes, t.waiting) for t in stats.tenants]

    assert policies(mine) == policies(theirs) == [("gold", 3.0, 60, 0, 0)]
    assert (mine.devices, mine.admitted_total, mine.rejected_total) == (
        theirs.devices,
        theirs.admitted_total,
        theirs.rejected_total,
    )


def test_ledger_from_url_refuses_an_option_no_ledger_has_and_leaves_redis_connection_options() -> None:
    with pytest.raises(TypeError, match="'tenats'"):
        ledger_from_url("memory://", 100, tenats={})
    with pytest.raises(TypeError, match="'tenats'"):
        ledger_from_url("redis://127.0.0.1:1", 100, tenats={})  # before anything connects
    ledger = ledger_from_url(None, 100, namespace="n", lease_ttl=5.0, on_unavailable="local", local_share=0.5)
    assert isinstance(ledger, Ledger)  # one call serves both configurations (docs/deployment.md)


def test_the_redis_connection_options_are_exactly_the_redis_ledgers_own() -> None:
    from gpu_asgi._ledger.redis.ledger import RedisLedger
    from gpu_asgi._ledger.url import REDIS_CONNECTION_OPTIONS

    own = set(inspect.signature(RedisLedger).parameters) - {"redis", "capacity"} - set(SHARED_OPTIONS)
    assert own == REDIS_CONNECTION_OPTIONS


# -- the Lua as shipped -------------------------------------------------------------------------


def test_the_scripts_are_the_package_files_and_the_same_text_in_every_process() -> None:
    from gpu_asgi._ledger.redis import script_source

    for name in script_source.NAMES:
        parts = ("head", "clock", "prelude", name, "epilogue")
        assert script_source.SCRIPTS[name] == "".join(script_source.source(part) for part in parts)
    digests = {name: hashlib.sha1(text.encode()).hexdigest() for name, text in script_source.SCRIPTS.items()}
    code = "import hashlib; from gpu_asgi._ledger.redis import script_source; print({n: hashlib.sha1(t.encode()).hexdigest() for n, t in script_source.SCRIPTS.items()})"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str(digests)


def test_a_production_call_carries_no_clock() -> None:
    from redis.asyncio import Redis

    from gpu_asgi._ledger.redis import script_source
    from gpu_asgi._ledger.redis.scripts import LedgerScripts

    scripts = LedgerScripts(Redis(), "n", {"cuda:0": 1}, lease_ttl=3, heartbeat=1, max_bypass=1, max_queue=1, timeout=1)
    assert scripts._argv(("id", 5)) == [scripts._config, "", "id", 5]  # config, boot id, the script's own
    assert "redis.call('TIME')" in script_source.source("clock") and "ARGV" not in script_source.source("clock")
    assert all("table.remove(ARG)" not in text for text in script_source.SCRIPTS.values())


# -- Redis: try_reserve meant "always None"; reserve_if_free asks ----------------------------------


@requires_redis_server
async def test_a_redis_request_that_fits_is_granted_without_the_queued_path(
    redis_server: RedisServer, namespace: str
) -> None:
    """Issue 24 item 3: every Redis request took the queued path (try_reserve always answered
    None): now one that fits is granted by the reserve script's no-queue mode, and the middleware
    never calls ``reserve()`` for it."""
    from gpu_asgi._ledger.redis.ledger import RedisLedger

    from ._redis_clock import REDIS_TIMEOUT

    # A generous timeout: an answer slower than the default 1 s (a loaded machine) rightly
    # takes the queued path, which is not what this test is about.
    async with RedisLedger(redis_server.url, 1000, namespace=namespace, redis_timeout=REDIS_TIMEOUT) as ledger:
        queued: list[int] = []
        reserve = ledger.reserve

        async def spy(nbytes: int, **options: Any) -> Reservation:
            queued.append(nbytes)
            return await reserve(nbytes, **options)

        ledger.reserve = spy  # type: ignore[method-assign]
        held: list[int] = []

        @gpu_bound()
        async def generate(request: Request) -> JSONResponse:
            await request.body()
            held.append(ledger.statistics().in_flight)
            return JSONResponse({"ok": True})

        app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
        app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=1))
        async with client(app) as http:
            response = await http.post("/generate", json={"prompt": "hello there", "max_new_tokens": 4})
        assert response.status_code == 200 and queued == []
        await _redis.eventually(lambda: redis_server.ledger_state(namespace) == _redis.EMPTY)
