"""A process's serving phase: not ready yet, ready, draining; shared by the middleware, the health
router and the app.

- The app says when it can serve (:meth:`Lifecycle.mark_ready`, after its model has loaded and
  warmed up); ``/health/ready`` answers 503 until then.
- :meth:`Lifecycle.start_draining` (a SIGTERM, the lifespan shutdown, a preStop call) makes
  readiness 503 at once, refuses new GPU-bound requests with 503 ``shutting-down`` and fails every
  queued one the same way, at once; admitted requests run to their end. :meth:`Lifecycle.drain`
  also waits (bounded) for those to finish.

Everything here runs on the event loop, except :meth:`Lifecycle.install_signal_handlers`' handler,
which only schedules the drain onto it.

It is control, not observation: the gate (``_admission``) refuses and wakes requests by it, and
health (``_observe``) reports it. So it is a shared leaf beside ``_errors`` and ``_types``, which
any part may import; it imports no part (only the leaf ``_errors``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

from ._errors import ShuttingDown

logger = logging.getLogger("gpu_asgi")

#: What a refused client is told to wait before it tries again (on another replica, usually).
DEFAULT_SHUTDOWN_RETRY_AFTER = 1.0
#: How long :meth:`Lifecycle.drain` waits for admitted requests by default.
DEFAULT_DRAIN_TIMEOUT = 30.0
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_SignalHandler = Callable[[int, FrameType | None], Any] | int | None


class Lifecycle:
    """Readiness and drain for one process: ``lifecycle = Lifecycle()``, passed to the middleware
    (``lifecycle=``) and to ``health_router`` (``lifecycle=``).

    ``ready``: whether the app can serve from the start; by default it cannot until it calls
    :meth:`mark_ready`. ``retry_after``: the ``Retry-After`` seconds of a ``shutting-down`` answer.
    """

    def __init__(
        self, *, ready: bool = False, retry_after: float = DEFAULT_SHUTDOWN_RETRY_AFTER,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not retry_after > 0:
            raise ValueError("retry_after must be a positive number of seconds")
        self.retry_after = retry_after
        self._clock = clock
        self._app_ready = ready
        #: When the drain started (the clock's seconds); None while serving.
        self.draining_since: float | None = None
        self._in_flight = 0  # admitted requests whose response has not ended
        self._idle: asyncio.Event | None = None  # set while nothing is in flight, once someone waits
        self._queued: set[asyncio.Future[None]] = set()  # one per request waiting in the queue

    def __repr__(self) -> str:
        phase = "draining" if self.draining else "ready" if self._app_ready else "starting"
        return f"<Lifecycle {phase}, {self._in_flight} in flight, {len(self._queued)} queued>"

    # -- readiness ------------------------------------------------------------------------

    def mark_ready(self) -> None:
        """The app can serve (its model is loaded and warmed up): readiness may answer 200."""
        if not self._app_ready:
            logger.info("gpu_asgi: the app marked itself ready")
        self._app_ready = True

    def mark_not_ready(self) -> None:
        """The app cannot serve for now (reloading a model, say): readiness answers 503."""
        self._app_ready = False

    @property
    def app_ready(self) -> bool:
        return self._app_ready

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    @property
    def ready(self) -> bool:
        """The app said it is ready and the process is not draining."""
        return self._app_ready and not self.draining

    @property
    def in_flight(self) -> int:
        """Admitted requests whose response has not ended yet."""
        return self._in_flight

    @property
    def waiting(self) -> int:
        """Requests of this process waiting in the queue for bytes."""
        return len(self._queued)

    # -- drain ----------------------------------------------------------------------------

    def refusal(self) -> ShuttingDown:
        """The answer to a GPU-bound request while draining."""
        return ShuttingDown(
            "This server is shutting down and admits no new GPU work; retry on another replica.",
            retry_after=self.retry_after,
        )

    def start_draining(self) -> None:
        """Stop admitting: readiness 503, new and queued GPU-bound requests refused at once. Idempotent."""
        if self.draining:
            return
        self.draining_since = self._clock()
        logger.warning(
            "gpu_asgi: draining; %d admitted request(s) run to their end, %d queued are refused",
            self._in_flight, len(self._queued),
        )
        for stopping in self._queued:
            if not stopping.done():
                stopping.set_result(None)

    async def drain(self, timeout: float | None = DEFAULT_DRAIN_TIMEOUT) -> bool:
        """:meth:`start_draining`, then wait up to ``timeout`` seconds (None: no limit) for every
        admitted request to end. True when none is left."""
        self.start_draining()
        if self._in_flight:
            if self._idle is None:
                self._idle = asyncio.Event()
            try:
                async with asyncio.timeout(timeout):
                    await self._idle.wait()
            except TimeoutError:
                logger.warning("gpu_asgi: drain timed out with %d request(s) still running", self._in_flight)
        return self._in_flight == 0

    # -- what the middleware tells it -------------------------------------------------------

    def queued(self) -> asyncio.Future[None]:
        """A future that completes when a drain starts: the queue wait watches it beside the ledger.
        Hand it back to :meth:`dequeued` when the wait ends."""
        stopping: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.draining:
            stopping.set_result(None)
        self._queued.add(stopping)
        return stopping

    def dequeued(self, stopping: asyncio.Future[None]) -> None:
        self._queued.discard(stopping)

    def admitted(self) -> None:
        self._in_flight += 1
        if self._idle is not None:
            self._idle.clear()

    def finished(self) -> None:
        self._in_flight -= 1
        if not self._in_flight and self._idle is not None:
            self._idle.set()

    # -- hooks --------------------------------------------------------------------------------

    def install_signal_handlers(
        self, signals: Sequence[int] = DEFAULT_SIGNALS, *, delay: float = 0.0
    ) -> Callable[[], None]:
        """Drain on ``signals``, then hand each to the handler installed before (the server's own).

        Call it on the running loop, after the server has installed its handlers (in the lifespan
        startup: uvicorn and hypercorn install theirs before it). ``delay`` seconds pass between
        the drain and the server's handler: readiness answers 503 and new requests are refused
        while the server still listens, so load balancers see the replica go before its listener
        closes. Returns a function that puts the previous handlers back.
        """
        loop = asyncio.get_running_loop()
        previous: dict[int, _SignalHandler] = {}
        if threading.current_thread() is not threading.main_thread():
            # Python delivers signals to the main thread only (a TestClient runs the app in another).
            logger.info("gpu_asgi: not on the main thread, so no signal handler is installed")
            return lambda: None

        def forward(signum: int) -> None:
            handler = previous.get(signum)
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:  # nobody else handles it: its default action
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)

        def on_signal(signum: int, frame: FrameType | None) -> None:
            # Between two bytecodes of whatever the main thread runs: only schedule, never touch
            # the loop's state here.
            loop.call_soon_threadsafe(self.start_draining)
            if delay > 0:
                loop.call_soon_threadsafe(loop.call_later, delay, forward, signum)
            else:
                forward(signum)

        for signum in signals:
            previous[signum] = signal.getsignal(signum)
            signal.signal(signum, on_signal)

        def restore() -> None:
            for signum, handler in previous.items():
                if signal.getsignal(signum) is on_signal:
                    signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

        return restore

    @asynccontextmanager
    async def serving(
        self, *, drain_timeout: float | None = DEFAULT_DRAIN_TIMEOUT, signals: Sequence[int] = DEFAULT_SIGNALS,
        signal_delay: float = 0.0,
    ) -> AsyncIterator[Lifecycle]:
        """For the app's lifespan: drain on ``signals`` while serving, and at shutdown.

        ``async with lifecycle.serving(): yield`` in a FastAPI/Starlette lifespan.
        """
        restore = self.install_signal_handlers(signals, delay=signal_delay)
        try:
            yield self
        finally:
            restore()
            await self.drain(drain_timeout)
