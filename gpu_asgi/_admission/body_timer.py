"""Body-read deadlines, one sweep per event loop.

A timer per request (``asyncio.timeout`` or ``loop.call_later``) costs 3-7 µs on CPython 3.11
(a ``TimerHandle`` built in Python, a heap push, a cancel), measured inside the overhead
benchmark: about twice everything the minimal reference admission does. Body reads almost always
finish at once, so instead each event loop gets one callback per tick that cancels the reads
past their deadline. A read times out between ``timeout`` and ``timeout + tick`` seconds.

Each loop has its own sweep (found by the running loop, weakly held), so one middleware serves
any number of loops and threads; the sweep of one loop never touches another loop's tasks.
"""

from __future__ import annotations

import asyncio
import time
import weakref


class Deadlines:
    """Per-loop sweeps; :meth:`sweep` gives the running loop's."""

    def __init__(self, tick: float) -> None:
        self._tick = tick
        self._sweeps: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Sweep] = weakref.WeakKeyDictionary()

    def sweep(self) -> Sweep:
        loop = asyncio.get_running_loop()
        sweep = self._sweeps.get(loop)
        if sweep is None:
            sweep = self._sweeps[loop] = Sweep(loop, self._tick)
        return sweep


class Sweep:
    """Tasks of one loop to cancel once their deadline passes, checked every ``tick`` seconds.

    One watched read per task at a time (the middleware reads a body once), so the task itself is
    the key. Used only from its loop's thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, tick: float) -> None:
        self._loop = loop
        self._tick = tick
        self._entries: dict[asyncio.Task[object], float] = {}
        self._fired: set[asyncio.Task[object]] = set()
        self._scheduled = False

    def add(self, timeout: float) -> asyncio.Task[object]:
        """Watch the current task; returns the key to :meth:`discard` it with."""
        task: asyncio.Task[object] = asyncio.current_task(self._loop)  # type: ignore[assignment]
        self._entries[task] = time.monotonic() + timeout
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_later(self._tick, self._reap)
        return task

    def discard(self, task: asyncio.Task[object]) -> bool:
        """Stop watching; True when the deadline had fired (the task was cancelled for it)."""
        if self._entries.pop(task, None) is None and task in self._fired:
            self._fired.discard(task)
            return True
        return False

    def _reap(self) -> None:
        now = time.monotonic()
        for task, deadline in list(self._entries.items()):
            # The task is suspended inside its read (the entry is discarded before any other
            # await), so the cancellation lands in the read and nowhere else.
            if deadline <= now:
                del self._entries[task]
                self._fired.add(task)
                task.cancel()
        if self._entries:
            self._loop.call_later(self._tick, self._reap)
        else:
            self._scheduled = False
