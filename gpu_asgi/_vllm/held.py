"""A reservation this process holds for itself, resized on a timer: the base of the closed loop
on vLLM's KV-cache usage (``engine_usage``) and of the forecast that follows the answers
(``following``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from typing import ClassVar

from .._ledger.contract import BudgetLedger, Reservation
from .log import logger

#: The most of the event loop's time the readings may take: one that took longer spaces the next
#: ones out (a large cache with hundreds of answers), rather than slow the server down.
MAX_SHARE = 0.1


def spacing_after(interval: float, spent: float) -> float:
    """Seconds from one reading's start to the next's: ``interval``, or more where the reading took
    ``spent`` seconds, so that readings take at most ``MAX_SHARE`` of the time."""
    return max(interval, spent / MAX_SHARE)


class HeldOnATimer:
    """Every ``interval`` (or more: :func:`spacing_after`): take the reservation once (zero bytes, for
    ``tenant``), then ``resize()``."""

    #: Whose bytes these are, as ``/health`` and the metrics show them.
    tenant: ClassVar[str]
    #: The asyncio task's name.
    task_name: ClassVar[str]

    def __init__(self, ledger: BudgetLedger, interval: float) -> None:
        self.ledger = ledger
        self.interval = interval
        self.held: Reservation | None = None
        #: Seconds between the starts of the last two readings (``interval`` until one is slow).
        self.spacing = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.held is not None:
            self.held.release()
            self.held = None

    async def tick(self) -> None:
        """One round: the reservation taken if it is not yet (a zero-byte grant never queues), then resized."""
        if self.held is None:
            self.held = await self.ledger.reserve_if_free(0, tenant=self.tenant)
        if self.held is not None and not self.held.released:
            self.resize()

    def resize(self) -> None:
        raise NotImplementedError

    async def _run(self) -> None:
        while True:
            started = time.perf_counter()
            try:
                await self.tick()
            except Exception:  # one bad reading must not stop the loop; the next may work
                logger.debug("%s failed", self.task_name, exc_info=True)
            spent = time.perf_counter() - started
            self.spacing = spacing_after(self.interval, spent)
            await asyncio.sleep(self.spacing - spent)


def resize_all(targets: Iterable[tuple[Reservation, int]]) -> None:
    """Every reservation to its target bytes: the growths first, so the ledger never holds less
    than both the old and the new sizes need, and a waiter it admits on a shrink fits after both."""
    targets = list(targets)
    for reservation, nbytes in targets:
        if nbytes > reservation.nbytes:
            reservation.grow(nbytes)
    for reservation, nbytes in targets:
        if nbytes < reservation.nbytes:
            reservation.shrink(nbytes)
