"""Cheap deadlines for body reads.

``asyncio.timeout`` costs about 7 µs per use (a timer handle pushed on the loop's heap and a
context object), which is a third of a trivial endpoint's whole cost. Body reads almost always
finish at once, so instead one loop callback per tick looks for reads past their deadline and
cancels those tasks. A read times out between ``timeout`` and ``timeout + tick`` seconds.
"""

from __future__ import annotations

import asyncio
import itertools


class Deadlines:
    """Tasks to cancel once their deadline passes, checked every ``tick`` seconds."""

    def __init__(self, tick: float) -> None:
        self._tick = tick
        self._entries: dict[int, tuple[float, asyncio.Task[object]]] = {}
        self._fired: set[int] = set()
        self._keys = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False

    def add(self, timeout: float) -> int:
        """Watch the current task; returns the key to :meth:`discard` it with."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (tests, reloads): timers of the old one are gone
            self._loop, self._scheduled = loop, False
            self._entries.clear()
            self._fired.clear()
        key = next(self._keys)
        self._entries[key] = (loop.time() + timeout, asyncio.current_task())  # type: ignore[assignment]
        if not self._scheduled:
            self._scheduled = True
            loop.call_later(self._tick, self._reap)
        return key

    def discard(self, key: int) -> bool:
        """Stop watching; True when the deadline had fired (the task was cancelled for it)."""
        self._entries.pop(key, None)
        if key in self._fired:
            self._fired.discard(key)
            return True
        return False

    def _reap(self) -> None:
        loop = self._loop
        if loop is None:
            return
        now = loop.time()
        for key, (deadline, task) in list(self._entries.items()):
            # The task is suspended inside its read (the entry is discarded before any other
            # await), so the cancellation lands in the read and nowhere else.
            if deadline <= now:
                del self._entries[key]
                self._fired.add(key)
                task.cancel()
        if self._entries:
            loop.call_later(self._tick, self._reap)
        else:
            self._scheduled = False
