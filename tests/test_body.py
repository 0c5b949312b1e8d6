"""Body reading under deadlines: timeouts are ours, other cancellations pass through."""

from __future__ import annotations

import asyncio

import pytest

from gpu_asgi import BodyTimeout, BodyTooLarge
from gpu_asgi._body import read_body
from gpu_asgi._deadlines import Deadlines


async def test_a_read_past_its_deadline_times_out_and_the_task_goes_on() -> None:
    deadlines = Deadlines(tick=0.01)

    async def never() -> dict[str, object]:
        await asyncio.Event().wait()
        raise AssertionError

    with pytest.raises(BodyTimeout):
        await read_body(never, 100, 0.03, deadlines)
    await asyncio.sleep(0.05)  # the task was uncancelled: it keeps running normally
    assert not deadlines._entries and not deadlines._fired


async def test_an_outside_cancellation_is_not_turned_into_a_timeout() -> None:
    deadlines = Deadlines(tick=0.01)
    started = asyncio.Event()

    async def never() -> dict[str, object]:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError

    task = asyncio.ensure_future(read_body(never, 100, 10.0, deadlines))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not deadlines._entries


async def test_fast_reads_are_not_touched_by_the_reaper() -> None:
    deadlines = Deadlines(tick=0.01)
    messages = iter([{"type": "http.request", "body": b"ab", "more_body": True},
                     {"type": "http.request", "body": b"cd", "more_body": False}])

    async def receive() -> dict[str, object]:
        return next(messages)

    assert await read_body(receive, 100, 0.01, deadlines) == b"abcd"
    await asyncio.sleep(0.05)  # the reaper runs, finds nothing, and stops rescheduling
    assert not deadlines._scheduled


async def test_oversized_chunked_body_is_refused_while_reading() -> None:
    chunks = iter([{"type": "http.request", "body": b"x" * 60, "more_body": True}] * 2)

    async def receive() -> dict[str, object]:
        return next(chunks)

    with pytest.raises(BodyTooLarge):
        await read_body(receive, 100, 1.0, Deadlines(tick=0.5))
