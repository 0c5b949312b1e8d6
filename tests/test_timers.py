"""``gpu_asgi._timers.DelayedCalls``: many calls of one delay on one timer per event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from gpu_asgi._timers import DelayedCalls

from ._asgi import in_threads


async def test_each_call_is_made_its_delay_after_it_was_asked_for_unless_cancelled() -> None:
    loop = asyncio.get_running_loop()
    calls = DelayedCalls(0.2)
    made: dict[str, float] = {}
    asked = loop.time()
    calls.call(lambda: made.setdefault("first", loop.time() - asked))
    cancelled = calls.call(lambda: made.setdefault("cancelled", loop.time() - asked))
    await asyncio.sleep(0.1)
    second = calls.call(lambda: made.setdefault("second", loop.time() - asked))
    cancelled.cancel()
    await asyncio.sleep(1.0)
    assert set(made) == {"first", "second"}
    # Timers never fire early; on a busy machine they may fire late, hence the wide upper bounds.
    assert 0.199 <= made["first"] < 0.6, made
    assert 0.299 <= made["second"] < 0.9, made  # its own delay, not the first's moment
    assert second.fired and not cancelled.fired
    assert calls.pending() == 0


async def test_the_timer_is_not_set_again_once_nothing_is_left() -> None:
    calls = DelayedCalls(0.02)
    for call in [calls.call(lambda: None) for _ in range(50)]:
        call.cancel()
    await asyncio.sleep(0.05)  # the one timer fired, found nothing, and was not set again
    assert calls.pending() == 0
    assert calls._loops[asyncio.get_running_loop()].timer is None


async def test_a_failing_call_is_reported_and_the_others_are_still_made() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        calls, made = DelayedCalls(0.01), []

        def fail() -> None:
            raise ValueError("boom")

        calls.call(fail)
        calls.call(lambda: made.append("after"))
        await asyncio.sleep(0.05)
    finally:
        loop.set_exception_handler(None)
    assert made == ["after"]
    assert [type(context["exception"]) for context in reported] == [ValueError]


def test_calls_on_several_loops_at_once_each_run_on_their_own_loop() -> None:
    calls = DelayedCalls(0.03)
    ran_on: list[bool] = []

    def run() -> None:
        async def main() -> None:
            loop, done = asyncio.get_running_loop(), asyncio.Event()
            calls.call(lambda: (ran_on.append(asyncio.get_running_loop() is loop), done.set()))
            await asyncio.wait_for(done.wait(), 5)

        asyncio.run(main())

    in_threads(run, 3, 10)
    assert ran_on == [True, True, True]
