"""The closed loop on what vLLM really uses: its own KV-cache usage, corrected into the ledger.

With learned lengths a non-streamed answer that runs past its prediction grows inside vLLM where
gpu_asgi cannot see it. vLLM's API server process receives the engine's KV-cache usage for its
``/metrics`` (``vllm:kv_cache_usage_perc``, the share of the usable blocks held). When the cache
holds more than the ledger has reserved, the difference is blocks that answers grew into: one
reservation of this process, the *correction*, is grown to hold them (past the budget if need be,
so nothing new is admitted until the cache is back under) and shrunk again as they come back.
"""

from __future__ import annotations

from typing import Any

from .._estimate.paged import blocks_for
from .._ledger.contract import BudgetLedger, Reservation
from .held import HeldOnATimer, resize_all

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


class EngineUsage(HeldOnATimer):
    """Keeps the correction equal to the blocks the cache holds beyond the ledger's reservations."""

    tenant = ENGINE_TENANT
    task_name = "gpu_asgi-vllm-usage"

    def __init__(
        self, ledger: BudgetLedger, registry: Any, *, cache_bytes: int, block_bytes: int,
        interval: float = DEFAULT_INTERVAL,
    ) -> None:
        super().__init__(ledger, interval)
        self.registry = registry
        self.cache_bytes = cache_bytes
        self.block_bytes = block_bytes

    @property
    def correction(self) -> Reservation | None:
        """The reservation that holds the blocks answers grew into (None until the first round)."""
        return self.held

    def excess(self) -> int | None:
        """Bytes the cache holds beyond the clients' reservations, in whole blocks; None unread."""
        usage = read_usage(self.registry)
        if usage is None:
            return None
        used = usage * self.cache_bytes
        held = self.held.nbytes if self.held is not None else 0
        reserved = self.ledger.statistics().reserved_bytes - held
        return max(0, blocks_for(int(used - reserved), self.block_bytes)) * self.block_bytes

    def resize(self) -> None:
        excess = self.excess()
        if excess is not None and self.held is not None:
            resize_all([(self.held, excess)])

    async def correct(self) -> None:
        """One reading, corrected into the ledger."""
        await self.tick()
