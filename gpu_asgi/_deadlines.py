"""Cheap deadlines for body reads.

``asyncio.timeout`` costs about 7 µs per use (a timer handle pushed on the loop's heap and a
context object), which is a third of a trivial endpoint's whole cost. Body reads almost always
finish at once, so instead one loop callback per tick looks for reads past their deadline and
cancels those tasks. A read times out between ``timeout`` and ``timeout + tick`` seconds.
"""

from __future__ import annotations

import asyncio
import time


class Deadlines:
    """Tasks to cancel once their deadline passes, checked every ``tick`` seconds.

    One watched read per task at a time (the middleware reads a body once), so the task itself is
    the key: no counter, and ``discard`` is one dictionary pop. Deadlines are on ``time.monotonic``,
    which is cheaper to read than ``loop.time()``; the loop only schedules the sweep.
    """

    def __init__(self, tick: float) -> None:
        self._tick = tick
        self._entries: dict[asyncio.Task[object], float] = {}
        self._fired: set[asyncio.Task[object]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False

    def add(self, timeout: float) -> asyncio.Task[object]:
        """Watch the current task; returns the key to :meth:`discard` it with."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (tests, reloads): timers of the old one are gone
            self._loop, self._scheduled = loop, False
            self._entries.clear()
            self._fired.clear()
        task: asyncio.Task[object] = asyncio.current_task(loop)  # type: ignore[assignment]
        self._entries[task] = time.monotonic() + timeout
        if not self._scheduled:
            self._scheduled = True
            loop.call_later(self._tick, self._reap)
        return task

    def discard(self, task: asyncio.Task[object]) -> bool:
        """Stop watching; True when the deadline had fired (the task was cancelled for it)."""
        if self._entries.pop(task, None) is None and task in self._fired:
            self._fired.discard(task)
            return True
        return False

    def _reap(self) -> None:
        loop = self._loop
        if loop is None:
            return
        now = time.monotonic()
        for task, deadline in list(self._entries.items()):
            # The task is suspended inside its read (the entry is discarded before any other
            # await), so the cancellation lands in the read and nowhere else.
            if deadline <= now:
                del self._entries[task]
                self._fired.add(task)
                task.cancel()
        if self._entries:
            loop.call_later(self._tick, self._reap)
        else:
            self._scheduled = False
