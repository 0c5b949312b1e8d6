"""The closed loop on what vLLM really uses: its own KV-cache usage, corrected into the ledger.

With learned lengths a non-streamed answer that runs past its prediction grows inside vLLM where
gpu_asgi cannot see it. vLLM's API server process receives the engine's KV-cache usage for its
``/metrics`` (``vllm:kv_cache_usage_perc``, the share of the usable blocks held). When the cache
holds more than the ledger has reserved, the difference is blocks that answers grew into: one
reservation of this process, the *correction*, is grown to hold them (past the budget if need be,
so nothing new is admitted until the cache is back under) and shrunk again as they come back.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from .._ledger.contract import BudgetLedger, Reservation
from .log import logger

#: The tenant the correction is held for (shown beside the clients' in ``/health``).
ENGINE_TENANT = "gpu_asgi.engine"
USAGE_METRIC = "vllm:kv_cache_usage_perc"
#: Seconds between two readings: vLLM records the usage once per engine step.
DEFAULT_INTERVAL = 0.1



def read_usage(registry: Any, metric: str = USAGE_METRIC) -> float | None:
    """The highest usage any engine reports (0..1) in ``registry``, or None while it has none."""
    values = [
        sample.value
        for family in registry.restricted_registry([metric]).collect()
        for sample in family.samples
        if sample.name == metric
    ]
    return max(values) if values else None


class EngineUsage:
    """Keeps the correction equal to the blocks the cache holds beyond the ledger's reservations."""

    def __init__(
        self, ledger: BudgetLedger, registry: Any, *, cache_bytes: int, block_bytes: int,
        interval: float = DEFAULT_INTERVAL,
    ) -> None:
        self.ledger = ledger
        self.registry = registry
        self.cache_bytes = cache_bytes
        self.block_bytes = block_bytes
        self.interval = interval
        self.correction: Reservation | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="gpu_asgi-vllm-usage")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.correction is not None:
            self.correction.release()
            self.correction = None

    async def _run(self) -> None:
        while True:
            try:
                await self.correct()
            except Exception:  # a reading or a ledger that failed once: the next one may not
                logger.debug("KV-cache usage correction failed", exc_info=True)
            await asyncio.sleep(self.interval)

    def excess(self) -> int | None:
        """Bytes the cache holds beyond the clients' reservations, in whole blocks; None unread."""
        usage = read_usage(self.registry)
        if usage is None:
            return None
        used = usage * self.cache_bytes
        held = self.correction.nbytes if self.correction is not None else 0
        reserved = self.ledger.statistics().reserved_bytes - held
        blocks = max(0, -(-int(used - reserved) // self.block_bytes))
        return blocks * self.block_bytes

    async def correct(self) -> None:
        excess = self.excess()
        if excess is None:
            return
        if self.correction is None:
            # Taken at the first reading, when nobody waits yet (a zero-byte grant never queues).
            self.correction = await self.ledger.reserve_if_free(0, tenant=ENGINE_TENANT)
            if self.correction is None:
                return
        if excess > self.correction.nbytes:
            self.correction.grow(excess)
        elif excess < self.correction.nbytes:
            self.correction.shrink(excess)
