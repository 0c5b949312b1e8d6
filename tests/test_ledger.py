"""The in-process ledger: atomic reservations, fair queueing, cancellation safety, statistics."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest

from gpu_asgi import Ledger, NeverFits, QueueFull, QueueTimeout, Reservation
from gpu_asgi._ledger.drain import RATE_WINDOW, DrainRate

from ._asgi import settle


def busy(seconds: float) -> float:
    """The drain rate's weighted busy seconds after ``seconds`` of busy time from none."""
    return RATE_WINDOW * -math.expm1(-seconds / RATE_WINDOW)


#: The rate right after a release of 100 bytes at the end of every busy second (the setup below):
#: 100 / busy(1), about 101.7 bytes per busy second.
STEADY_100 = 100 / busy(1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_reserve_and_release_return_every_byte() -> None:
    ledger = Ledger(100)
    reservation = await ledger.reserve(60)
    assert (reservation.device, reservation.nbytes) == ("cuda:0", 60)
    assert ledger.statistics().reserved_bytes == 60
    assert reservation.release() == 60
    assert reservation.release() == 0  # exactly once
    assert ledger.statistics().reserved_bytes == 0
    assert ledger.statistics().in_flight == 0


async def test_request_larger_than_budget_is_rejected_at_once() -> None:
    ledger = Ledger(100)
    with pytest.raises(NeverFits) as caught:
        await ledger.reserve(101)
    assert caught.value.extensions == {"required_bytes": 101, "budget_bytes": 100}
    assert caught.value.status == 413
    assert ledger.statistics().rejected_total == {"exceeds-budget": 1}


async def test_waiters_are_admitted_fifo_as_bytes_come_back() -> None:
    ledger = Ledger(100)
    first = await ledger.reserve(100)
    order: list[int] = []

    async def wait(index: int) -> Reservation:
        reservation = await ledger.reserve(50)
        order.append(index)
        return reservation

    tasks = [asyncio.ensure_future(wait(i)) for i in range(4)]
    await settle()
    assert ledger.statistics().waiting == 4
    first.release()
    await settle()
    assert order == [0, 1]
    for task in tasks[:2]:
        task.result().release()
    await settle()
    assert order == [0, 1, 2, 3]
    for task in tasks[2:]:
        task.result().release()
    assert ledger.statistics().reserved_bytes == 0


async def test_small_requests_pass_a_blocked_head_at_most_max_bypass_times() -> None:
    ledger = Ledger(100, max_bypass=2)
    holder = await ledger.reserve(60)
    big = asyncio.ensure_future(ledger.reserve(80))  # head of the queue, does not fit
    await settle()
    small = [await asyncio.wait_for(ledger.reserve(10), 1) for _ in range(2)]  # pass the head twice
    third = asyncio.ensure_future(ledger.reserve(10))  # would fit, but the head is owed its turn
    await settle()
    assert not third.done() and not big.done()
    holder.release()
    for reservation in small:
        reservation.release()
    await settle()
    assert big.done() and third.done()
    big.result().release()
    third.result().release()
    assert ledger.statistics().reserved_bytes == 0


async def test_queue_bound_and_timeout() -> None:
    ledger = Ledger(100, max_queue=1, max_wait=0.01)
    holder = await ledger.reserve(100)
    waiting = asyncio.ensure_future(ledger.reserve(10))
    await settle()
    with pytest.raises(QueueFull) as full:
        await ledger.reserve(10)
    assert full.value.retry_after is not None and full.value.retry_after > 0
    with pytest.raises(QueueTimeout):
        await waiting
    assert ledger.statistics().waiting == 0
    assert ledger.statistics().rejected_total == {"queue-full": 1, "queue-timeout": 1}
    holder.release()


async def test_cancelled_waiter_leaves_the_queue_and_unblocks_others() -> None:
    ledger = Ledger(100)
    holder = await ledger.reserve(50)
    big = asyncio.ensure_future(ledger.reserve(90))
    await settle()
    small = asyncio.ensure_future(ledger.reserve(40))
    await settle()
    assert small.done()  # bypassed the blocked head once
    small.result().release()
    big.cancel()
    await settle()
    assert ledger.statistics().waiting == 0
    after = await asyncio.wait_for(ledger.reserve(50), 1)
    holder.release()
    after.release()
    assert ledger.statistics().reserved_bytes == 0


async def test_waiter_cancelled_in_the_instant_it_is_granted_passes_the_bytes_on() -> None:
    ledger = Ledger(100)
    holder = await ledger.reserve(100)
    first = asyncio.ensure_future(ledger.reserve(100))
    second = asyncio.ensure_future(ledger.reserve(100))
    await settle()
    holder.release()  # grants `first` synchronously: its future is resolved, its task not yet resumed
    first.cancel()
    await settle()
    assert first.cancelled()
    assert second.done(), "the bytes granted to the cancelled waiter went to the next one"
    second.result().release()
    assert ledger.statistics().reserved_bytes == 0


async def test_shrink_returns_bytes_early_and_admits_waiters() -> None:
    ledger = Ledger(100)
    reservation = await ledger.reserve(100)
    waiter = asyncio.ensure_future(ledger.reserve(30))
    await settle()
    assert reservation.shrink(70) == 30
    await settle()
    assert waiter.done()
    assert reservation.nbytes == 70
    assert reservation.release() == 70
    waiter.result().release()
    assert ledger.statistics().reserved_bytes == 0


async def test_several_devices_place_on_one_that_fits() -> None:
    ledger = Ledger({"cuda:0": 100, "cuda:1": 50})
    a = await ledger.reserve(60)
    assert a.device == "cuda:0"
    b = await ledger.reserve(45)
    assert b.device == "cuda:1"
    c = await ledger.reserve(40)
    assert c.device == "cuda:0"
    with pytest.raises(NeverFits):
        await ledger.reserve(60, devices=["cuda:1"])
    with pytest.raises(ValueError, match="unknown device"):
        await ledger.reserve(1, devices=["cuda:7"])
    stats = ledger.statistics()
    assert [(d.name, d.reserved_bytes, d.in_flight) for d in stats.devices] == [("cuda:0", 100, 2), ("cuda:1", 45, 1)]
    for r in (a, b, c):
        r.release()


async def test_priority_orders_the_queue() -> None:
    ledger = Ledger(10)
    holder = await ledger.reserve(10)
    low = asyncio.ensure_future(ledger.reserve(10, priority=0))
    high = asyncio.ensure_future(ledger.reserve(10, priority=5))
    await settle()
    holder.release()
    await settle()
    assert high.done() and not low.done()
    high.result().release()
    await settle()
    low.result().release()


async def test_retry_after_follows_the_observed_release_rate() -> None:
    clock = FakeClock()
    ledger = Ledger(1000, clock=clock, max_wait=30)
    assert ledger.retry_after(500) == 30  # nothing observed yet: fall back to max_wait
    for _ in range(10):  # 100 bytes per busy second for 10 s
        reservation = await ledger.reserve(100)
        clock.now += 1
        reservation.release()
    holder = await ledger.reserve(1000)
    assert ledger.release_rate() == pytest.approx(STEADY_100)
    assert ledger.retry_after(500) == pytest.approx(500 / STEADY_100)  # 500 bytes behind a full device
    clock.now += 3  # no release since: the rate is read as of now, slower the longer nothing comes back
    later = STEADY_100 * busy(10) * math.exp(-3 / RATE_WINDOW) / busy(13)
    assert ledger.release_rate() == pytest.approx(later) and ledger.retry_after(500) == pytest.approx(500 / later)
    holder.release()


def test_the_release_rate_counts_only_busy_time_that_moves_forward() -> None:
    """A clock that stands still or steps back adds no busy time and decays nothing; the time
    after it counts from the latest reading."""
    rate = DrainRate(100.0)
    rate.advance(100.0, busy=True)
    rate.advance(101.5, busy=True)
    first = RATE_WINDOW * (1 - math.exp(-1.5 / RATE_WINDOW))
    assert (rate.seconds, rate.last) == (first, 101.5)
    rate.released(30)
    for now in (101.5, 90.0):
        rate.advance(now, busy=True)
        assert (rate.bytes, rate.seconds, rate.last) == (30.0, first, 101.5)
    rate.advance(102.5, busy=False)
    decay = math.exp(-1.0 / RATE_WINDOW)
    seconds = first * decay + RATE_WINDOW * (1 - decay)
    assert (rate.bytes, rate.seconds, rate.last, rate.busy) == (30.0 * decay, seconds, 102.5, False)
    rate.advance(200.0, busy=True)  # idle: neither decayed nor counted
    assert (rate.bytes, rate.seconds, rate.last) == (30.0 * decay, seconds, 200.0)


async def test_idle_time_does_not_drag_the_release_rate_down() -> None:
    """After a 20 s (or an hour's) idle spell the rate is the one seen while the GPU was busy."""
    clock = FakeClock()
    ledger = Ledger(1000, clock=clock, max_wait=30)
    for _ in range(10):
        reservation = await ledger.reserve(100)
        clock.now += 1
        reservation.release()
    assert ledger.release_rate() == pytest.approx(STEADY_100)
    for gap in (20, 3600):
        before = ledger.release_rate()
        clock.now += gap
        assert ledger.release_rate() == before  # idle: neither decayed nor counted
        holder = await ledger.reserve(1000)
        assert ledger.retry_after(500) == pytest.approx(500 / before)
        clock.now += 10
        holder.release()  # 1000 bytes over 10 busy seconds: about the same rate
        assert ledger.release_rate() == pytest.approx(STEADY_100, rel=0.15)


async def test_retry_after_counts_the_bytes_ahead_of_the_request() -> None:
    """Ahead of a new request: waiters at its priority or higher, in its size class or a smaller
    one. A larger waiter that does not fit is passed, a lower priority one waits behind it."""
    clock = FakeClock()
    ledger = Ledger(1000, clock=clock, max_wait=30)
    for _ in range(10):  # 100 bytes per busy second (STEADY_100)
        reservation = await ledger.reserve(100)
        clock.now += 1
        reservation.release()
    holder = await ledger.reserve(1000)
    big = asyncio.ensure_future(ledger.reserve(900))  # class 10
    low = asyncio.ensure_future(ledger.reserve(200, priority=-1))  # class 8, lower priority
    await settle()
    assert ledger.retry_after(300) == pytest.approx(300 / STEADY_100)  # class 9: nothing ahead of it
    assert ledger.retry_after(250, priority=-1) == pytest.approx(450 / STEADY_100)  # the 200 at its priority
    assert ledger.retry_after(600) == pytest.approx(1500 / STEADY_100)  # the 900 (its class), not the 200
    holder.release()
    for task in (big, low):
        (await task).release()


@pytest.mark.parametrize(("max_bypass", "ahead"), [(8, 1800), (20, 900)])
async def test_retry_after_counts_a_larger_head_that_claims_before_the_request(max_bypass: int, ahead: int) -> None:
    """Nine smaller waiters ahead pass a larger head at most ``max_bypass`` times: with 8, the
    ninth admission ahead finds it claiming its device, so its 900 bytes go first too."""
    clock = FakeClock()
    ledger = Ledger(1000, clock=clock, max_wait=30, max_bypass=max_bypass)
    for _ in range(10):  # 100 bytes per busy second (STEADY_100)
        reservation = await ledger.reserve(100)
        clock.now += 1
        reservation.release()
    holder = await ledger.reserve(1000)
    tasks = [asyncio.ensure_future(ledger.reserve(900))]
    tasks += [asyncio.ensure_future(ledger.reserve(100)) for _ in range(9)]
    await settle()
    assert ledger.retry_after(100) == pytest.approx((ahead + 100) / STEADY_100)
    for task in tasks:
        task.cancel()
    holder.release()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert ledger.statistics().reserved_bytes == 0


@pytest.mark.parametrize("max_wait", [float("inf"), 3600.0, 1e300, 0.0])
async def test_retry_after_is_finite_and_clamped_for_any_max_wait(max_wait: float) -> None:
    ledger = Ledger(100, max_wait=max_wait, max_queue=0)
    holder = await ledger.reserve(100)
    with pytest.raises(QueueFull) as full:
        await ledger.reserve(50)
    assert 1.0 <= full.value.retry_after <= 600.0  # type: ignore[operator]
    assert 1.0 <= ledger.retry_after(10**18) <= 600.0
    holder.release()


async def test_reservation_is_a_context_manager() -> None:
    ledger = Ledger(10)
    with await ledger.reserve(10) as reservation:
        assert ledger.statistics().reserved_bytes == 10
    assert reservation.released
    assert ledger.statistics().reserved_bytes == 0


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError):
        Ledger(0)
    with pytest.raises(ValueError):
        Ledger({})


def test_a_shrink_and_a_release_on_two_threads_give_each_byte_back_once() -> None:
    """A worker thread shrinks while the loop releases (the endpoint returned): the thread's read
    of what is held and its update are one step, so the bytes cannot be given back twice."""
    given: list[int] = []

    class Recorder:
        def give_back(self, reservation: Reservation, nbytes: int, *, finished: bool) -> None:
            given.append(nbytes)

    slot = Reservation.__dict__["_held"]  # the slot the base class keeps what it holds in
    releasing: list[threading.Thread] = []

    class Interleaved(Reservation):
        """Starts the other thread's release right after shrink has read what is held."""

        __slots__ = ()

        @property  # type: ignore[override]
        def _held(self) -> int:
            value: int = slot.__get__(self)
            if not releasing:
                releasing.append(thread := threading.Thread(target=self.release))
                thread.start()
                thread.join(0.2)  # it finishes in this window unless shrink's read and update are one step
            return value

        @_held.setter
        def _held(self, value: int) -> None:
            slot.__set__(self, value)

    reservation = Interleaved(Recorder(), "r1", "cuda:0", 100, 0.0)  # type: ignore[arg-type]
    reservation.shrink(30)
    releasing[0].join(10)
    assert sum(given) == 100 and reservation.nbytes == 0 and reservation.released
