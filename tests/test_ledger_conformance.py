"""One decision rule, two ledgers: every scenario here runs unchanged against the in-process
``Ledger`` and the ``RedisLedger`` (a real redis-server), and asserts the same decisions.

The rule is stated once in docs/admission.md, "The ledger". The random counterpart, which
drives both ledgers with the same inputs and fails on the first decision that differs, is the
hypothesis state machine in test_ledger_properties.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpu_asgi import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    BudgetLedger,
    NeverFits,
    QueueFull,
    QueueTimeout,
    Reservation,
    gpu_bound,
)

from . import _redis
from ._backends import BACKENDS, Backend, open_backend, start

redis_server, namespace = _redis.redis_server, _redis.namespace  # fixtures


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    async with open_backend(request) as opened:
        yield opened


async def granted(task: asyncio.Future[Reservation]) -> Reservation:
    return await asyncio.wait_for(task, 5)


async def queue(backend: Backend, ledger: BudgetLedger, nbytes: int, **options: Any) -> asyncio.Task[Reservation]:
    """A waiter that has joined the queue (arrival order between waiters is then certain)."""
    task = start(ledger, nbytes, **options)
    await backend.quiet()
    assert not task.done(), "expected it to wait"
    return task


async def test_waiters_of_one_lane_are_admitted_first_come_first_served(backend: Backend) -> None:
    ledger = backend.make(100)
    holder = await ledger.reserve(100)
    waiters = [await queue(backend, ledger, 100) for _ in range(3)]
    previous = holder
    for index, waiter in enumerate(waiters):
        previous.release()
        previous = await granted(waiter)
        assert await backend.still_waiting(*waiters[index + 1 :])
    previous.release()


async def test_higher_priority_is_admitted_first(backend: Backend) -> None:
    ledger = backend.make(10)
    holder = await ledger.reserve(10)
    low = await queue(backend, ledger, 10, priority=0)
    high = await queue(backend, ledger, 10, priority=5)
    holder.release()
    reservation = await granted(high)
    assert await backend.still_waiting(low)
    reservation.release()
    (await granted(low)).release()


async def test_later_requests_pass_a_head_that_does_not_fit_at_most_max_bypass_times(backend: Backend) -> None:
    ledger = backend.make(100, max_bypass=2)
    holder = await ledger.reserve(60)
    big = await queue(backend, ledger, 80)
    small = [await granted(start(ledger, 10)) for _ in range(2)]  # pass the head twice
    third = start(ledger, 10)  # would fit, but the head is owed its turn
    assert await backend.still_waiting(big, third)
    holder.release()
    for reservation in small:
        reservation.release()
    for reservation in [await granted(big), await granted(third)]:
        reservation.release()


async def test_higher_priorities_pass_a_lower_head_at_most_max_bypass_times(backend: Backend) -> None:
    """The issue's starvation case: a stream of high-priority small requests used to pass a
    low-priority head without limit (40 passes with max_bypass=2) until it timed out."""
    ledger = backend.make(100, max_bypass=2)
    holder = await ledger.reserve(60)
    low = await queue(backend, ledger, 80, priority=0)
    passed = 0
    for _ in range(40):
        high = start(ledger, 10, priority=7)
        if await backend.still_waiting(high):
            break
        passed += 1
        high.result().release()
    assert passed == 2
    holder.release()
    (await granted(low)).release()
    (await granted(high)).release()


async def test_a_head_waiting_for_one_device_never_blocks_another(backend: Backend) -> None:
    """The issue's cross-device case: cuda:0 stayed at 0 of 100 bytes while its requests timed out."""
    ledger = backend.make({"cuda:0": 100, "cuda:1": 100}, max_bypass=2)
    busy = await ledger.reserve(100, devices=["cuda:1"])
    head = await queue(backend, ledger, 80, devices=["cuda:1"])
    on_idle = [await granted(start(ledger, 10, devices=["cuda:0"])) for _ in range(8)]
    assert {r.device for r in on_idle} == {"cuda:0"}
    anywhere = await granted(start(ledger, 10))  # may use either device: placed on the idle one
    assert anywhere.device == "cuda:0"
    assert await backend.still_waiting(head)
    busy.release()
    (await granted(head)).release()
    for reservation in [*on_idle, anywhere]:
        reservation.release()


async def test_a_head_passed_max_bypass_times_keeps_only_its_own_devices(backend: Backend) -> None:
    ledger = backend.make({"cuda:0": 100, "cuda:1": 100}, max_bypass=1)
    busy = await ledger.reserve(80, devices=["cuda:1"])
    head = await queue(backend, ledger, 50, devices=["cuda:1"])
    passer = await granted(start(ledger, 10, devices=["cuda:1"]))  # the one pass it allows
    held_back = start(ledger, 10, devices=["cuda:1"], priority=9)  # fits, but cuda:1 is the head's now
    elsewhere = await granted(start(ledger, 10))  # may use either: goes to cuda:0
    assert elsewhere.device == "cuda:0"
    assert await backend.still_waiting(head, held_back)
    busy.release()
    first = await granted(head)
    assert first.device == "cuda:1"
    for reservation in (first, passer, elsewhere, await granted(held_back)):
        reservation.release()


async def test_requests_of_one_size_class_stay_in_arrival_order(backend: Backend) -> None:
    """Only lane heads are looked at: 65 bytes would fit in the 70 free, but it shares the blocked
    80-byte head's lane (64-127 bytes, same priority, same devices), so it waits its turn."""
    ledger = backend.make(100)
    holder = await ledger.reserve(30)
    head = await queue(backend, ledger, 80)
    behind = start(ledger, 65)
    smaller = await granted(start(ledger, 20))  # another lane: passes the head
    assert await backend.still_waiting(head, behind)
    holder.release()
    smaller.release()
    (await granted(head)).release()
    (await granted(behind)).release()


@pytest.mark.parametrize("priority", [MAX_PRIORITY + 1, MIN_PRIORITY - 1, 1 << 30, 1.5, True])
async def test_priorities_outside_the_range_are_refused_alike(backend: Backend, priority: Any) -> None:
    ledger = backend.make(100)
    with pytest.raises(ValueError, match=f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}"):
        await ledger.reserve(1, priority=priority)
    for edge in (MIN_PRIORITY, MAX_PRIORITY):
        (await ledger.reserve(1, priority=edge)).release()


async def test_bounds_and_refusals_are_the_same(backend: Backend) -> None:
    ledger = backend.make({"cuda:0": 100, "cuda:1": 50}, max_queue=1, max_wait=float("inf"))
    with pytest.raises(NeverFits) as never:
        await ledger.reserve(60, devices=["cuda:1"])
    assert never.value.extensions == {"required_bytes": 60, "budget_bytes": 50}
    with pytest.raises(ValueError, match="unknown device"):
        await ledger.reserve(1, devices=["cuda:7"])
    holders = [await ledger.reserve(100), await ledger.reserve(50)]
    waiting = await queue(backend, ledger, 10)
    with pytest.raises(QueueFull) as full:
        await ledger.reserve(10)
    assert full.value.retry_after is not None and 1 <= full.value.retry_after <= 600  # max_wait=inf, clamped
    for reservation in holders:
        reservation.release()
    (await granted(waiting)).release()


async def test_a_release_from_a_worker_thread_wakes_the_queue_at_once(backend: Backend) -> None:
    """A sync ``def`` endpoint releasing in the threadpool: the waiter is admitted while the
    thread still runs (the wake-up used to wait until the thread returned)."""
    ledger = backend.make(100)
    holder = await ledger.reserve(100)
    waiter = await queue(backend, ledger, 50)
    done = threading.Event()

    def endpoint() -> float:
        time.sleep(0.2)  # the loop is idle, waiting on its selector, when the bytes come back
        released = time.monotonic()
        holder.release()
        done.wait(10)  # the endpoint goes on working
        return released

    thread = asyncio.ensure_future(asyncio.to_thread(endpoint))
    try:
        await asyncio.wait([waiter])
        admitted = time.monotonic()
    finally:
        done.set()
    assert admitted - await thread < 5, "the wake-up waited for the worker thread to return"
    waiter.result().release()


async def test_a_second_running_event_loop_gets_a_clear_error(backend: Backend) -> None:
    ledger = backend.make(100)
    (await ledger.reserve(10)).release()  # serves this loop now
    errors: list[BaseException] = []

    def other_loop() -> None:
        async def use() -> None:
            (await ledger.reserve(10)).release()

        try:
            asyncio.run(use())
        except BaseException as exc:
            errors.append(exc)

    await asyncio.to_thread(other_loop)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "another running event loop" in str(errors[0])
    (await ledger.reserve(10)).release()  # this loop still works


def test_a_route_with_a_priority_out_of_range_is_refused_when_declared() -> None:
    with pytest.raises(ValueError, match="priority must be an integer"):
        gpu_bound(priority=MAX_PRIORITY + 1)
    gpu_bound(priority=MIN_PRIORITY)  # the edges are fine


# -- the protocol: every member means the same in both ledgers (contract.BudgetLedger) -----------


async def test_reserve_if_free_grants_what_fits_while_nobody_waits_and_never_queues(backend: Backend) -> None:
    ledger = backend.make({"cuda:0": 100, "cuda:1": 50})
    assert isinstance(ledger, BudgetLedger) and ledger.availability == "available"
    first = await ledger.reserve_if_free(60)
    assert first is not None and (first.device, first.nbytes, first.waited) == ("cuda:0", 60, 0.0)
    assert await ledger.reserve_if_free(60) is None  # fits no device now: None, nothing queued
    with pytest.raises(NeverFits):
        await ledger.reserve_if_free(101)  # waiting could never help: refused, as reserve() refuses it
    waiter = await queue(backend, ledger, 60)
    assert await ledger.reserve_if_free(10) is None  # 40 + 50 bytes free, but never ahead of a waiter
    await backend.queued(ledger, 1)
    first.release()
    (await granted(waiter)).release()
    second = await ledger.reserve_if_free(50, devices=["cuda:1"])
    assert second is not None and second.device == "cuda:1"
    second.release()
    # A Redis ledger's statistics are as of its last state read: wait for one after the last change.
    await _redis.eventually(lambda: ledger.statistics().waiting == 0, timeout=10)


async def test_give_back_is_told_the_bytes_returned_in_both_ledgers(backend: Backend) -> None:
    """``give_back``'s ``nbytes`` has one meaning: the bytes this call returns (the reservation's
    ``nbytes`` is already what it keeps)."""
    ledger = backend.make(100)
    calls: list[tuple[int, int, bool]] = []
    give_back = ledger.give_back

    def spy(reservation: Reservation, nbytes: int, *, finished: bool) -> None:
        calls.append((nbytes, reservation.nbytes, finished))
        give_back(reservation, nbytes, finished=finished)

    ledger.give_back = spy  # type: ignore[method-assign]
    reservation = await ledger.reserve(100)
    assert reservation.shrink(30) == 70
    assert reservation.release() == 30
    assert calls == [(70, 30, False), (30, 0, True)]
    (await asyncio.wait_for(ledger.reserve(100), 5)).release()  # every byte came back


async def test_one_deadline_bounds_the_wait_by_max_wait_and_the_old_pair_still_works(backend: Backend) -> None:
    """``deadline`` is cut to ``max_wait``; ``timeout=`` and ``wait_limit=`` still work for a release,
    with a DeprecationWarning, and may not be mixed with it."""
    ledger = backend.make(100, max_wait=0.3)
    holder = await ledger.reserve(100)
    begun = time.monotonic()
    with pytest.raises(QueueTimeout):
        await asyncio.wait_for(ledger.reserve(10, deadline=1000), 10)  # no drain rate yet: it queues
    assert time.monotonic() - begun < 5  # max_wait's 0.3 s, not the deadline's 1000
    with pytest.raises(QueueTimeout), pytest.warns(DeprecationWarning, match="deadline="):
        await asyncio.wait_for(ledger.reserve(10, timeout=0.1), 10)
    with pytest.raises(TypeError, match="deadline= alone"):
        await ledger.reserve(10, deadline=1, wait_limit=1)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="deadline"):
            await ledger.reserve(10, deadline=bad)
    holder.release()
    # A Redis ledger's statistics are as of its last state read: wait for one after the last change.
    await _redis.eventually(lambda: ledger.statistics().waiting == 0, timeout=10)
