"""Cancel an admitted endpoint whose client disconnects before the response starts.

Starlette cancels a streaming response when its client leaves, but a plain handler runs to its
end, holding its bytes, for nobody. After admission the responder keeps one ``receive()``
pending (the next message after the body can only be ``http.disconnect``); when it completes
with a disconnect before ``http.response.start`` was sent, the task serving the request is
cancelled. The middleware absorbs that cancellation once the endpoint has unwound, and only
then are the bytes released: an endpoint that waits for its device work on cancellation
(``DeviceExecutor``, ``anyio.to_thread.run_sync``) keeps them until that work has stopped.

The pending ``receive()`` starts :data:`WATCH_DELAY` after admission, not at admission: an
endpoint that answers sooner (a cached answer, a refusal of its own, anything short of a
generation) never needs one, and pays an entry among the delayed calls (``gpu_asgi._timers``,
one timer per loop for all of them) instead of a task and a callback of its own. A client that
leaves in that moment is noticed when it ends: the watch's first read returns the disconnect.

A plain ``def`` endpoint is never cancelled: it runs on a worker thread that nothing can stop,
and cancelling the task that awaits it would only release its bytes while it still runs.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import Any

from .._timers import DelayedCall, DelayedCalls
from .._types import Message

CANCEL_MESSAGE = "gpu_asgi: the client disconnected before the response started"
#: Seconds from admission to the start of the watch's pending ``receive()``: the most a disconnect
#: in that moment waits to be noticed, against a generation's seconds.
WATCH_DELAY = 0.02
_watch_starts = DelayedCalls(WATCH_DELAY)


def start_watch_later(start: Callable[[], object]) -> DelayedCall:
    """Call ``start`` (it starts a watch's pending read) :data:`WATCH_DELAY` from now, unless cancelled."""
    return _watch_starts.call(start)


def cancellable(endpoint: Any) -> bool:
    """False for a synchronous function endpoint (Starlette and FastAPI run it on a thread), also
    behind ``@gpu_bound``'s wrapper, which awaits that thread. Decided once per endpoint."""
    try:
        return _cancellable(endpoint)
    except TypeError:  # an unhashable endpoint: decided each time
        return _cancellable.__wrapped__(endpoint)


@functools.lru_cache(maxsize=1024)
def _cancellable(endpoint: Any) -> bool:
    endpoint = inspect.unwrap(endpoint) if inspect.isfunction(endpoint) else endpoint
    return not (inspect.isfunction(endpoint) and not inspect.iscoroutinefunction(endpoint))


class DisconnectWatch:
    """Watches one pending ``receive()`` of an admitted request, for the task that serves it."""

    __slots__ = ("_task", "fired", "response_started")

    def __init__(self) -> None:
        self._task = asyncio.current_task()
        #: Set by the responder when ``http.response.start`` goes out: too late to cancel then
        #: (a stream is the server's and Starlette's to end).
        self.response_started = False
        #: True once this watch has cancelled the task.
        self.fired = False

    def follow(self, pending: asyncio.Future[Message]) -> None:
        """Cancel the task if ``pending`` (the server's next message) is a disconnect."""
        pending.add_done_callback(self._on_message)

    def _on_message(self, pending: asyncio.Future[Message]) -> None:
        if pending.cancelled() or pending.exception() is not None or self.response_started:
            return
        task = self._task
        if pending.result()["type"] == "http.disconnect" and task is not None and not task.done():
            self.fired = True
            task.cancel(CANCEL_MESSAGE)

    def absorbs(self, error: BaseException) -> bool:
        """True when ``error`` is this watch's cancellation and nobody else's (a server cancelling
        the task at the same time keeps its own): the task is uncancelled, the request is over."""
        if not self.fired or not isinstance(error, asyncio.CancelledError) or self._task is None:
            return False
        self.fired = False
        return self._task.uncancel() == 0
