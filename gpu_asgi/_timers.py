"""Calls made a fixed delay after they are asked for, with one asyncio timer per event loop.

Each tagged request asks for two calls of this kind: its body read's deadline (``body_timeout``
after the read starts) and the start of its disconnect watch (a moment after admission). With
``loop.call_later`` each would be a timer of its own, a heap entry the loop orders, then cancels
and discards: most of what a tagged request cost above the least an admission can do. All the
calls of one :class:`DelayedCalls` share its delay, so they fall due in the order they were
asked for: one timer waits for the oldest, and is set again for the next one when it fires.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

#: A call due this close to now is made with the others: the loop runs a timer up to its clock's
#: resolution early, and a call made this much early is no one's concern.
_SLACK = 1e-3


class DelayedCalls:
    """``loop.call_later(delay, callback)`` for many callbacks of one delay, on any number of loops
    (one per thread) at once."""

    __slots__ = ("_last", "_loops", "delay")

    def __init__(self, delay: float) -> None:
        self.delay = delay
        #: The loop of the last call and its queue: the one loop a server runs, without a lookup.
        self._last: tuple[asyncio.AbstractEventLoop, _LoopQueue] | None = None
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopQueue] = weakref.WeakKeyDictionary()

    def call(self, callback: Callable[[], object]) -> DelayedCall:
        """Call ``callback`` on the running loop ``delay`` seconds from now, unless cancelled first."""
        loop = asyncio.get_running_loop()
        last = self._last
        if last is None or last[0] is not loop:
            queue = self._loops.get(loop)
            if queue is None:
                queue = self._loops[loop] = _LoopQueue(loop)
            self._last = last = (loop, queue)
        return last[1].add(callback, self.delay)

    def pending(self) -> int:
        """Calls asked for on the running loop and neither made nor cancelled yet."""
        queue = self._loops.get(asyncio.get_running_loop())
        return 0 if queue is None else len(queue.calls)


class DelayedCall:
    """One call asked for: :meth:`cancel` it, or read :attr:`fired` to know whether it was made."""

    __slots__ = ("at", "callback", "fired", "queue")

    def __init__(self, queue: _LoopQueue, callback: Callable[[], object], at: float) -> None:
        self.queue = queue
        self.callback = callback
        self.at = at
        #: True once the callback has been called.
        self.fired = False

    def cancel(self) -> None:
        """Not to be made (a no-op once it was)."""
        self.queue.calls.pop(self, None)


class _LoopQueue:
    """The calls asked for on one loop, oldest first, and the one timer for the oldest."""

    __slots__ = ("calls", "loop", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.calls: dict[DelayedCall, None] = {}  # insertion order is the order they fall due (one delay)
        self.timer: asyncio.TimerHandle | None = None

    def add(self, callback: Callable[[], object], delay: float) -> DelayedCall:
        call = DelayedCall(self, callback, self.loop.time() + delay)
        self.calls[call] = None
        if self.timer is None:
            self.timer = self.loop.call_at(call.at, self._due)
        return call

    def _due(self) -> None:
        """Make every call that is due, then wait for the oldest one left (if any)."""
        self.timer = None
        now = self.loop.time() + _SLACK
        calls = self.calls
        while calls:
            call = next(iter(calls))
            if call.at > now:
                self.timer = self.loop.call_at(call.at, self._due)
                return
            del calls[call]
            call.fired = True
            try:
                call.callback()
            except Exception as error:  # as the loop does with a timer's: reported, the others still made
                self.loop.call_exception_handler({"message": "gpu_asgi: a delayed call failed", "exception": error})
