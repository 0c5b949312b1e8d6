"""The demo's own Prometheus instruments, served by gpu_asgi's ``/metrics`` next to its own."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Histogram

BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
GROWTH_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class DemoMetrics:
    """``demo_batch_size``, ``demo_generated_tokens_total``, ``demo_time_to_first_token_seconds``, and
    with learned lengths the batches' growth (``demo_batch_growth_*``)."""

    def __init__(self, registry: Any, *, namespace: str = "demo") -> None:
        common = {"namespace": namespace, "registry": registry}
        self.batch_size = Histogram(
            "batch_size", "Sequences per generate call (1: no batching).", buckets=BATCH_BUCKETS, **common
        )
        self.generated_tokens = Counter("generated_tokens", "Tokens generated, over all sequences.", **common)
        self.borrowed_bytes = Counter(
            "padding_borrowed_bytes",
            "Bytes borrowed from the ledger to pad requests of different lengths into one batch.",
            **common,
        )
        self.time_to_first_token = Histogram(
            "time_to_first_token_seconds",
            "From the request reaching the batcher (admitted) to its first generated token.",
            buckets=TTFT_BUCKETS,
            **common,
        )
        self.growth_bytes = Counter(
            "batch_growth_bytes",
            "Bytes running batches borrowed from the ledger to decode past their requests' learned lengths.",
            **common,
        )
        self.growth_wait = Histogram(
            "batch_growth_wait_seconds",
            "How long a running batch paused for the bytes to decode past its requests' learned lengths.",
            buckets=GROWTH_WAIT_BUCKETS,
            **common,
        )
        self.growth_denied = Counter(
            "batch_growth_denied",
            "Batches that got no bytes to grow within max_wait and ended their answers there (finish_reason length).",
            **common,
        )
