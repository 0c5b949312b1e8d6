"""Reservations that grow and settle, the same in both ledgers (``Reservation.grow`` beside
``shrink``): a growth is counted at once, past the budget if need be; while a device is over its
budget nobody new is admitted on it; the bytes come back exactly once, grown ones included."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from gpu_asgi import Ledger, Reservation

from . import _redis
from ._backends import BACKENDS, Backend, open_backend

redis_server, namespace = _redis.redis_server, _redis.namespace  # fixtures


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    async with open_backend(request) as opened:
        yield opened


def reserved_in(backend: Backend, ledger: object) -> int:
    """The bytes the ledger holds: its own count (memory), or what Redis holds (redis)."""
    if backend.server is not None:
        return int(backend.server.ledger_state(ledger.namespace)["reserved"])  # type: ignore[attr-defined, call-overload]
    return ledger.statistics().reserved_bytes  # type: ignore[attr-defined, no-any-return]


async def test_a_reservation_grows_past_the_budget_and_nobody_new_is_admitted_until_it_is_back_under(
    backend: Backend,
) -> None:
    ledger = backend.make(100)
    reservation = await ledger.reserve(60)
    assert reservation.grow(130) == 70
    assert reservation.nbytes == 130 and reservation.requested_bytes == 60
    await backend.quiet()
    assert reserved_in(backend, ledger) == 130
    assert await ledger.reserve_if_free(0) is None  # over the budget: not even zero bytes fit
    waiter = asyncio.ensure_future(ledger.reserve(10))
    await backend.quiet()
    assert reservation.shrink(95) == 35  # 95 + 10 > 100: still nobody
    assert await backend.still_waiting(waiter)
    assert reservation.shrink(90) == 5  # 90 + 10 = 100: the waiter fits now
    admitted = await asyncio.wait_for(waiter, 5)
    assert reservation.release() == 90 and admitted.release() == 10
    await backend.quiet()
    assert reserved_in(backend, ledger) == 0
    (await asyncio.wait_for(ledger.reserve(100), 5)).release()  # every byte came back, grown ones too


async def test_grow_adds_only_what_is_not_held_and_nothing_once_released(backend: Backend) -> None:
    ledger = backend.make(100)
    reservation = await ledger.reserve(40)
    assert reservation.grow(30) == 0 and reservation.grow(40) == 0  # already held
    assert reservation.grow(50) == 10
    with pytest.raises(ValueError):
        reservation.grow(-1)
    assert reservation.release() == 50
    assert reservation.grow(80) == 0 and reservation.nbytes == 0
    await backend.quiet()
    assert reserved_in(backend, ledger) == 0


async def test_grows_and_shrinks_from_a_worker_thread_land_in_order(backend: Backend) -> None:
    """The amounts a shared ledger sends are absolute: many changes from a thread must end at the last."""
    ledger = backend.make(1000)
    reservation = await ledger.reserve(10)

    def churn() -> None:
        for step in range(1, 40):
            reservation.grow(10 + 20 * step)
            reservation.shrink(10 + 10 * step)

    worker = threading.Thread(target=churn)
    worker.start()
    await asyncio.to_thread(worker.join)
    await backend.quiet()
    assert reservation.nbytes == 400
    await _redis.eventually(lambda: reserved_in(backend, ledger) == 400, timeout=10)
    reservation.release()
    await _redis.eventually(lambda: reserved_in(backend, ledger) == 0, timeout=10)


async def test_growth_counts_against_the_tenants_quota(backend: Backend) -> None:
    from gpu_asgi import TenantPolicy

    ledger = backend.make(100, tenants={"small": TenantPolicy(quota_bytes=50)})
    reservation = await ledger.reserve(20, tenant="small")
    reservation.grow(50)
    await backend.quiet()
    assert await ledger.reserve_if_free(10, tenant="small") is None  # its quota is full with the growth
    other = await ledger.reserve_if_free(10, tenant="other")
    assert other is not None
    other.release()
    reservation.release()


async def test_a_reservation_handed_over_grows_its_heir_and_nobody_waiting_is_granted_its_bytes(
    backend: Backend,
) -> None:
    """``hand_over``: the bytes of a reservation released go to its heir, not back to the ledger
    (vLLM's following lends an ending answer's blocks to the growth of those that outlive it)."""
    ledger = backend.make(100)
    answer, heir = await ledger.reserve(60), await ledger.reserve(10)
    waiter = asyncio.ensure_future(ledger.reserve(50))
    assert await backend.still_waiting(waiter)
    answer.hand_over(heir)
    assert answer.release() == 60
    assert heir.nbytes == 70 and answer.nbytes == 0
    assert await backend.still_waiting(waiter)  # 70 + 50 > 100: the 60 never were free
    assert reserved_in(backend, ledger) == 70
    assert heir.shrink(50) == 20  # what the heir's forecast no longer needs goes back
    admitted = await asyncio.wait_for(waiter, 5)
    admitted.release(), heir.release()
    await backend.quiet()
    assert reserved_in(backend, ledger) == 0


async def test_bytes_handed_to_a_released_heir_or_taken_back_go_to_the_ledger(backend: Backend) -> None:
    ledger = backend.make(100)
    first, second, heir = await ledger.reserve(40), await ledger.reserve(30), await ledger.reserve(0)
    first.hand_over(heir)
    second.hand_over(heir)
    second.hand_over(None)  # taken back
    assert second.release() == 30 and heir.nbytes == 0
    heir.release()
    assert first.release() == 40 and heir.nbytes == 0  # the heir is gone: back to the ledger
    await backend.quiet()
    assert reserved_in(backend, ledger) == 0
    (await asyncio.wait_for(ledger.reserve(100), 5)).release()


async def test_a_reservation_hands_over_only_to_another_of_its_device() -> None:
    ledger = Ledger({"cuda:0": 100, "cuda:1": 100})
    here, there = await ledger.reserve(10, devices=["cuda:0"]), await ledger.reserve(10, devices=["cuda:1"])
    with pytest.raises(ValueError, match="same device"):
        here.hand_over(there)
    with pytest.raises(ValueError, match="same device"):
        here.hand_over(here)

    class NoGrow(Ledger):
        grow = None  # type: ignore[assignment]

    with pytest.raises(NotImplementedError, match="heir"):
        here.hand_over(Reservation(NoGrow(10), "r1", "cuda:0", 5, 0.0))
    here.release(), there.release()
    assert ledger.statistics().reserved_bytes == 0


def test_a_ledger_without_grow_says_so() -> None:
    class NoGrow(Ledger):
        grow = None  # type: ignore[assignment]

    reservation = Reservation(NoGrow(10), "r1", "cuda:0", 5, 0.0)
    with pytest.raises(NotImplementedError, match="cannot grow"):
        reservation.grow(8)
    assert reservation.nbytes == 5
