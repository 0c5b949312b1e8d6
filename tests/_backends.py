"""Both ledgers behind one test interface: tests that take the ``backend`` fixture built by
:func:`open_backend` run unchanged against the in-process ``Ledger`` and the ``RedisLedger`` (a
real redis-server; skipped when none is on PATH)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest

from gpu_asgi import DEFAULT_TENANT, BudgetLedger, Ledger, Reservation

from ._asgi import settle
from ._redis import REDIS_SERVER, RedisServer, eventually

#: ``@pytest.fixture(params=BACKENDS)``: the in-process ledger, then Redis when a server is on PATH.
BACKENDS = [
    "memory",
    pytest.param("redis", marks=pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not on PATH")),
]


class Clock:
    """Seconds that move only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Backend:
    """Makes ledgers of one kind; ``quiet()`` waits long enough for any decision to have landed.

    With a ``clock``, every ledger it makes reads time from it (and a Redis lease lasts an hour of
    it, so that jumps of the clock expire none).
    """

    def __init__(
        self,
        kind: str,
        make: Callable[..., BudgetLedger],
        quiet: Callable[[], Awaitable[None]],
        waiting: Callable[[BudgetLedger], int],
        clock: Clock | None,
        server: RedisServer | None = None,
    ) -> None:
        self.kind = kind
        self.make = make
        self.quiet = quiet
        self._waiting = waiting
        self._clock = clock
        self.server = server

    @property
    def clock(self) -> Clock:
        assert self._clock is not None, "this backend's ledgers keep real time"
        return self._clock

    async def queued(self, ledger: BudgetLedger, count: int) -> None:
        """Until exactly ``count`` requests wait in ``ledger`` (so arrival order is certain)."""
        if self.kind == "memory":
            await self.quiet()
        await eventually(lambda: self._waiting(ledger) == count, timeout=5)

    async def still_waiting(self, *tasks: asyncio.Future[Reservation]) -> bool:
        await self.quiet()
        return not any(task.done() for task in tasks)


def open_backend(request: pytest.FixtureRequest, *, clock: Clock | None = None) -> AbstractAsyncContextManager[Backend]:
    """The fixture's ``request.param`` backend ("memory" or "redis")."""
    if request.param == "memory":
        return open_ledgers("memory", clock=clock)
    return open_ledgers(
        "redis", clock=clock, server=request.getfixturevalue("redis_server"), name=request.getfixturevalue("namespace")
    )


@asynccontextmanager
async def open_ledgers(
    kind: str, *, clock: Clock | None = None, server: RedisServer | None = None, name: str = ""
) -> AsyncIterator[Backend]:
    """A backend of ``kind`` ("memory", or "redis" on ``server`` under namespace ``name``); the
    Redis ledgers it made are closed after."""
    timed: dict[str, Any] = {} if clock is None else {"clock": clock}
    if kind == "memory":
        yield Backend(
            "memory",
            lambda capacity, **options: Ledger(capacity, **timed, **options),
            settle,
            lambda ledger: ledger.statistics().waiting,
            clock,
        )
        return
    from gpu_asgi._ledger.redis.ledger import RedisLedger

    from ._redis_clock import redis_ledger as clocked_ledger

    assert server is not None
    made: list[RedisLedger] = []
    leases: dict[str, Any] = {} if clock is None else {"lease_ttl": 3600.0}

    def make(capacity: Any, **options: Any) -> RedisLedger:
        ledger = clocked_ledger(server.url, capacity, namespace=name, **timed, **{**leases, **options})
        made.append(ledger)
        return ledger

    def waiting(ledger: BudgetLedger) -> int:
        return int(server.ledger_state(name)["tickets"])  # type: ignore[call-overload]

    try:
        yield Backend("redis", make, lambda: asyncio.sleep(0.25), waiting, clock, server)
    finally:
        for ledger in made:
            await ledger.aclose()


def start(ledger: BudgetLedger, nbytes: int, **options: Any) -> asyncio.Task[Reservation]:
    """``ledger.reserve(nbytes, ...)`` as a task of its own."""
    return asyncio.ensure_future(ledger.reserve(nbytes, **options))


async def heavy_backlog(
    backend: Backend, ledger: BudgetLedger, *, then: float = 2
) -> tuple[Reservation, list[asyncio.Task[Reservation]]]:
    """A drain rate of 10 bytes per busy second, the whole budget (100) held by "heavy", and
    four "heavy" waiters of 20 bytes queued behind it, ``then`` seconds later: the holder and the
    waiters."""
    for _ in range(5):
        reservation = await ledger.reserve(100, tenant="heavy")
        backend.clock.advance(10)
        reservation.release()
    holder = await ledger.reserve(100, tenant="heavy")
    heavy = [start(ledger, 20, tenant="heavy") for _ in range(4)]
    await backend.queued(ledger, 4)
    backend.clock.advance(then)
    return holder, heavy


class SpyLedger(Ledger):
    """Records the tenant of every request that asks for bytes (in the flood tests, tenants are
    API-key hashes, so a keyless request would ask as "default")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[str] = []

    def try_reserve(self, nbytes: int, **options: Any) -> Reservation | None:
        self.asked.append(options.get("tenant", DEFAULT_TENANT))
        return super().try_reserve(nbytes, **options)

    async def reserve(self, nbytes: int, **options: Any) -> Reservation:
        self.asked.append(options.get("tenant", DEFAULT_TENANT))
        return await super().reserve(nbytes, **options)


def recording(ledger: BudgetLedger) -> list[float | None]:
    """Record the ``deadline`` of each ``reserve`` the middleware makes on ``ledger``."""
    timeouts: list[float | None] = []
    reserve = ledger.reserve

    async def spy(nbytes: int, **options: Any) -> Reservation:
        timeouts.append(options.get("deadline"))
        return await reserve(nbytes, **options)

    ledger.reserve = spy  # type: ignore[method-assign]
    return timeouts
