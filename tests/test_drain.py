"""The drain rate is a function of the history only: of releases and busy time, never of when or
how often a ledger advanced it (``gpu_asgi._ledger.drain``; its Lua twin in ``_ledger/redis/lua/prelude.lua``)."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_asgi import DeadlineUnmeetable
from gpu_asgi._ledger.drain import MIN_BUSY_SPAN, RATE_WINDOW, DrainRate, drain_rate

from . import _redis
from ._backends import BACKENDS, Backend, Clock, open_backend
from ._redis import RedisServer, requires_redis_server

redis_server, namespace = _redis.redis_server, _redis.namespace  # fixtures


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    async with open_backend(request, clock=Clock()) as opened:
        yield opened


#: (seconds since the previous event, busy from then on, bytes released then, instants of extra
#: ``advance`` calls within the gap as fractions of it)
EVENTS = st.lists(
    st.tuples(
        st.floats(0, 90),
        st.booleans(),
        st.sampled_from([0, 0, 1, 700, 10**9]),
        st.lists(st.floats(0, 1), max_size=4),
    ),
    max_size=30,
)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


@given(events=EVENTS, tail=st.floats(0, 90))
def test_extra_advances_at_any_instant_change_nothing(
    events: list[tuple[float, bool, int, list[float]]], tail: float
) -> None:
    """The in-process ledger advances its rate at grants and releases, the Redis scripts at every
    call: the same history gives the same bytes, seconds and rate either way."""
    plain, polled = DrainRate(0.0), DrainRate(0.0)
    now, busy = 0.0, False
    for gap, busy_after, nbytes, polls in events:
        for fraction in sorted(polls):  # looks in between, the state unchanged
            polled.advance(now + gap * fraction, busy=busy)
        now += gap
        busy = busy_after
        for rate in (plain, polled):
            rate.advance(now, busy=busy)
            if nbytes:
                rate.released(nbytes)
    end = now + tail
    assert close(polled.rate_at(end), plain.rate_at(end)) or close(plain._at(end)[1], MIN_BUSY_SPAN)
    for rate in (plain, polled):
        rate.advance(end, busy=busy)
    assert close(polled.bytes, plain.bytes) and close(polled.seconds, plain.seconds)


def test_the_busy_seconds_are_the_continuous_average_of_busy_time() -> None:
    """``e`` busy seconds add ``RATE_WINDOW * (1 - exp(-e / RATE_WINDOW))``: short spells add
    about their length, the sum never exceeds ``RATE_WINDOW``; idle time adds nothing."""
    rate = DrainRate(0.0)
    rate.advance(0.0, busy=True)
    rate.advance(10.0, busy=False)
    rate.released(100)
    assert rate.seconds == pytest.approx(RATE_WINDOW * (1 - math.exp(-10 / RATE_WINDOW)), rel=1e-12)
    assert rate.rate_at(3600.0) == rate.rate_at(10.0) == pytest.approx(100 / rate.seconds, rel=1e-12)
    rate.advance(3600.0, busy=True)
    assert rate.rate_at(3600.0 + 1e6) < 1e-100  # busy for ever without a release: the rate goes to 0
    rate.advance(3600.0 + 1e6, busy=True)
    assert rate.seconds == pytest.approx(RATE_WINDOW, rel=1e-12)


def test_a_rate_is_unknown_until_a_release_and_a_busy_second() -> None:
    assert drain_rate(0.0, 20.0) == 0.0
    assert drain_rate(100.0, 0.9) == 0.0
    assert drain_rate(100.0, MIN_BUSY_SPAN) == 100.0


async def test_both_ledgers_know_a_rate_only_after_a_busy_second(backend: Backend) -> None:
    """One rule for both ledgers and for tenants' admission rates: a release after half a busy
    second gives no rate yet (``Retry-After`` is ``max_wait``, no deadline refusal); a second
    more of busy time, with nothing else released, does."""
    ledger = backend.make(100, max_wait=40)
    reservation = await ledger.reserve(100)
    backend.clock.advance(0.5)
    reservation.release()
    holder = await ledger.reserve(100)
    refresh = getattr(ledger, "refresh_statistics", None)  # Redis: a snapshot of this instant
    stats = await refresh() if refresh is not None else ledger.statistics()
    assert stats.release_rate_bytes_per_second == 0 and ledger.retry_after(50) == 40
    waiter = asyncio.ensure_future(ledger.reserve(50, wait_limit=2))  # not refused: it queues
    await backend.queued(ledger, 1)
    backend.clock.advance(1)
    stats = await refresh() if refresh is not None else ledger.statistics()
    expected = 100 * math.exp(-1 / RATE_WINDOW) / (RATE_WINDOW * -math.expm1(-1.5 / RATE_WINDOW))
    assert stats.release_rate_bytes_per_second == pytest.approx(expected, rel=1e-9)
    holder.release()
    (await asyncio.wait_for(waiter, 5)).release()


#: (milliseconds since the previous operation, operation, bytes, tenant, which live request)
OPERATIONS = st.lists(
    st.tuples(
        st.integers(0, 20_000),
        st.sampled_from(["reserve", "reserve", "leave", "poll"]),
        st.integers(10, 100),
        st.sampled_from(["a", "b"]),
        st.integers(0, 1000),
    ),
    max_size=25,
)


@requires_redis_server
@settings(max_examples=25, deadline=None)
@given(operations=OPERATIONS, tail=st.integers(0, 20_000))
def test_the_scripts_rates_do_not_depend_on_how_often_they_run(
    redis_server: RedisServer, operations: list[tuple[int, str, int, str, int]], tail: int
) -> None:
    """Two namespaces get the same reservations and departures at the same instants; one also
    gets claims in between (every script decays the drain rate). At the end both report the same
    drain rate and the same tenants' admission rates. Not heartbeats in between: a heartbeat also
    dispatches, and time alone can make a held-back head admissible (docs/admission.md, fair
    share), so an extra one may admit a waiter earlier and change the rates for a reason of its own."""
    asyncio.run(same_rates_with_and_without_polls(redis_server, operations, tail))


async def same_rates_with_and_without_polls(
    server: RedisServer, operations: list[tuple[int, str, int, str, int]], tail: int
) -> None:
    from redis.asyncio import Redis

    from gpu_asgi._ledger.redis.scripts import LedgerScripts

    from ._redis_clock import ClockedScripts

    now = [1000.0]
    client = Redis.from_url(server.url)

    def scripts() -> LedgerScripts:
        return ClockedScripts(
            client,
            f"drain-{uuid.uuid4().hex[:10]}",
            {"cuda:0": 100},
            lease_ttl=1e6,
            heartbeat=1e6,
            max_bypass=1,
            max_queue=100,
            timeout=10,
            clock=lambda: now[0],
        )

    plain, polled = scripts(), scripts()
    live: list[str] = []
    try:
        for gap, operation, nbytes, tenant, index in operations:
            now[0] += gap / 1000
            if operation == "poll":
                for rid in live:
                    await polled.claim(rid)
            elif operation == "reserve":
                live.append(f"r{len(live)}-{uuid.uuid4().hex[:6]}")
                answers = {await s.reserve(live[-1], nbytes, ["cuda:0"], 0, tenant) for s in (plain, polled)}
                assert len(answers) == 1
            elif live:
                rid = live.pop(index % len(live))
                assert await plain.leave(rid) == await polled.leave(rid)
        now[0] += tail / 1000
        one, other = await plain.heartbeat(live), await polled.heartbeat(live)
        assert close(one.released_bytes, other.released_bytes) and close(one.busy_seconds, other.busy_seconds)
        assert close(one.release_rate, other.release_rate) or close(one.busy_seconds, MIN_BUSY_SPAN)
        assert one.standings.keys() == other.standings.keys()
        for name, standing in one.standings.items():
            assert close(standing.rate, other.standings[name].rate)
    finally:
        await client.aclose()


async def test_both_ledgers_read_the_rate_as_of_now_between_releases(backend: Backend) -> None:
    """Five times 100 bytes held for 10 s, then the whole budget held for 20 s with nothing given
    back: 20 s after the last grant (no release since), both ledgers' rate, ``Retry-After`` and
    deadline decision are the closed form's at that instant, not the rate of the last grant."""
    ledger = backend.make(100, max_wait=1000)
    for _ in range(5):
        reservation = await ledger.reserve(100)
        backend.clock.advance(10)
        reservation.release()
    holder = await ledger.reserve(100)
    backend.clock.advance(20)
    d = math.exp(-10 / RATE_WINDOW)
    released = 100 * (1 + d + d**2 + d**3 + d**4) * math.exp(-20 / RATE_WINDOW)
    expected = released / (RATE_WINDOW * -math.expm1(-70 / RATE_WINDOW))
    refresh = getattr(ledger, "refresh_statistics", None)  # Redis: a snapshot of this instant
    stats = await refresh() if refresh is not None else ledger.statistics()
    assert stats.release_rate_bytes_per_second == pytest.approx(expected, rel=1e-9)
    assert ledger.retry_after(50) == pytest.approx(50 / expected, rel=1e-9)  # about 9.2 s
    with pytest.raises(DeadlineUnmeetable) as refused:
        await asyncio.wait_for(ledger.reserve(50, wait_limit=5), 10)
    assert refused.value.retry_after == pytest.approx(50 / expected, rel=1e-9)
    holder.release()


async def test_a_zero_byte_reservation_alone_is_no_busy_time_in_either_ledger(backend: Backend) -> None:
    """Busy time is time with bytes reserved, in both ledgers: 100 bytes held for 2 s and given
    back, then only a zero-byte reservation for 10 s: the rate is still that of the 2 busy seconds
    (the in-process ledger once counted the 10 s too, from the zero-byte grant on, and Redis not)."""
    ledger = backend.make(100, max_wait=1000)
    reservation = await ledger.reserve(100)
    backend.clock.advance(2)
    reservation.release()
    await backend.quiet()  # Redis: the release is sent in the background
    empty = await ledger.reserve(0)
    backend.clock.advance(10)
    expected = 100 / (RATE_WINDOW * -math.expm1(-2 / RATE_WINDOW))
    refresh = getattr(ledger, "refresh_statistics", None)  # Redis: a snapshot of this instant
    stats = await refresh() if refresh is not None else ledger.statistics()
    assert stats.release_rate_bytes_per_second == pytest.approx(expected, rel=1e-9)
    empty.release()
    await backend.quiet()
    holder = await ledger.reserve(100)  # bytes reserved again: the time counts from here
    backend.clock.advance(1)
    stats = await refresh() if refresh is not None else ledger.statistics()
    later = 100 * math.exp(-1 / RATE_WINDOW) / (RATE_WINDOW * -math.expm1(-3 / RATE_WINDOW))
    assert stats.release_rate_bytes_per_second == pytest.approx(later, rel=1e-9)
    holder.release()
