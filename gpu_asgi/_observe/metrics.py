"""Prometheus metrics (``prometheus-client``, the ``prometheus`` extra).

Counters and histograms are updated by the middleware as requests are decided. The state gauges
(queue, in flight, reserved/capacity bytes, device readings) cost nothing per request: a collector
reads ``ledger.statistics()`` and the sampler's snapshot when Prometheus scrapes. In multiprocess
mode (``PROMETHEUS_MULTIPROC_DIR`` set, for ``uvicorn --workers N``) a scrape reaches one worker
only, so each worker instead copies its state into multiprocess gauges once per
``refresh_interval``, from a task on its event loop. docs/metrics.md lists every metric.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Collection, Iterator
from typing import Any

from .._device.sampler import DeviceSampler
from .._ledger.contract import BudgetLedger, LedgerStatistics
from .._ledger.legacy import as_budget_ledger
from .._ledger.tenants import DEFAULT_TENANT
from .labels import OTHER_TENANT_LABEL, named_tenants, tenant_label
from .tracing import ADMITTED

PROMETHEUS_MISSING = "gpu_asgi's Prometheus metrics need prometheus-client: pip install 'gpu_asgi[prometheus]'."
DEFAULT_NAMESPACE = "gpu_asgi"
DEFAULT_REFRESH_INTERVAL = 1.0
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PEAK_RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
#: Learned lengths: the share of a request's declared limit that was reserved (1.0: the worst case).
RESERVED_SHARE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 0.9, 1.0)

#: (name, help, labels, multiprocess mode); ``ledger`` modes become ``livemax`` for a shared ledger.
LEDGER_GAUGES = (
    ("queue_depth", "Requests waiting for GPU memory.", (), "ledger"),
    ("queue_bytes", "Bytes requested by the requests waiting.", (), "ledger"),
    ("in_flight_requests", "Admitted requests still holding a reservation.", ("device",), "ledger"),
    ("reserved_bytes", "Bytes reserved by admitted requests.", ("device",), "ledger"),
    ("capacity_bytes", "The device's byte budget.", ("device",), "ledger"),
    ("ledger_failovers", "Times the shared ledger's Redis changed process (a failover, a restart from its "
     "files), each followed by a pause of grants; 0 in one process.", (), "ledger"),
)
#: Per tenant, from ``ledger.statistics().tenants``; ``tenant`` is a tenant named in advance,
#: ``default`` or ``other`` (every other tenant, summed). Shares are of the tenants present now.
TENANT_GAUGES = (
    ("tenant_reserved_bytes", "Bytes reserved by the tenant's admitted requests.", ("tenant",), "ledger"),
    ("tenant_waiting_requests", "The tenant's requests waiting for GPU memory.", ("tenant",), "ledger"),
    ("tenant_served_byte_seconds", "Bytes x seconds the tenant has held (the work the fair share divides).",
     ("tenant",), "ledger"),
    ("tenant_weight_share_ratio",
     "The tenant's weight over the weights of all tenants holding or waiting for bytes: its fair share (0-1).",
     ("tenant",), "livemax"),
    ("tenant_reserved_share_ratio", "The tenant's part of all reserved bytes now (0-1).", ("tenant",), "livemax"),
)
DEVICE_GAUGES = (
    (
        "device_memory_used_bytes",
        "Device memory in use, as the probe reads it (all processes).",
        ("device",),
        "livemax",
    ),
    ("device_memory_total_bytes", "Device memory in total, as the probe reads it.", ("device",), "livemax"),
    ("device_temperature_celsius", "GPU temperature.", ("device",), "livemax"),
    ("device_utilization_ratio", "Fraction of the last sample period a kernel ran (0-1).", ("device",), "livemax"),
    ("device_probe_up", "1 when the last probe read succeeded and is recent, else 0.", (), "livemin"),
)


def multiprocess_enabled() -> bool:
    """Whether prometheus-client runs in multiprocess mode: the one place this reads the environment."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir"))


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise RuntimeError(PROMETHEUS_MISSING) from None
    return prometheus_client


class GPUMetrics:
    """gpu_asgi's Prometheus instruments; pass it to the middleware and to ``health_router``.

    ``registry`` defaults to a private ``CollectorRegistry`` (pass ``prometheus_client.REGISTRY``
    to serve gpu_asgi's metrics with your own). ``multiprocess`` defaults to whether
    ``PROMETHEUS_MULTIPROC_DIR`` is set. ``shared_ledger=True`` (a Redis ledger, where every
    worker sees the same budget) aggregates ledger gauges across workers with ``max`` rather than ``sum``.
    """

    def __init__(
        self,
        ledger: BudgetLedger | None = None,
        *,
        sampler: DeviceSampler | None = None,
        registry: Any = None,
        namespace: str = DEFAULT_NAMESPACE,
        multiprocess: bool | None = None,
        shared_ledger: bool = False,
        refresh_interval: float = DEFAULT_REFRESH_INTERVAL,
        tenant_labels: Collection[str] | None = None,
    ) -> None:
        prom = _prometheus()
        self.ledger = None if ledger is None else as_budget_ledger(ledger)  # an earlier release's shape: adapted
        #: Tenants the per-tenant gauges name; any other is summed into "other". Default: the
        #: ledger's configured tenants (as the middleware's ``tenant_labels``).
        self.tenant_labels = named_tenants(self.ledger, tenant_labels)
        self.sampler = sampler
        self.namespace = namespace
        self.multiprocess = multiprocess_enabled() if multiprocess is None else multiprocess
        self.refresh_interval = refresh_interval
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        common = {"namespace": namespace, "registry": self.registry}
        self.admitted = prom.Counter("admitted", "Requests admitted, by device.", ["device"], **common)
        self.rejected = prom.Counter(
            "rejected", "Requests answered by gpu_asgi with an error, by reason.", ["reason"], **common
        )
        self.mispredicted = prom.Counter(
            "wait_mispredicted",
            "Requests that queued on a predicted wait within their deadline and timed out in the queue all the same.",
            **common,
        )
        self.clamped = prom.Counter(
            "max_new_tokens_clamped", "Requests whose max_new_tokens the thermal policy lowered.", **common
        )
        self.queue_wait = prom.Histogram(
            "queue_wait_seconds",
            "Time from arrival at the ledger to its decision, by outcome.",
            ["outcome"],
            buckets=WAIT_BUCKETS,
            **common,
        )
        # Per tenant: separate series, so the existing ones keep their labels; recorded only when
        # the middleware has a tenant key. ``tenant`` is already bounded (see tenant_label).
        self.tenant_admitted = prom.Counter(
            "tenant_admitted", "Requests admitted, by tenant.", ["tenant"], **common
        )
        self.tenant_rejected = prom.Counter(
            "tenant_rejected", "Requests refused by the ledger or timed out in its queue, by tenant and reason.",
            ["tenant", "reason"], **common
        )
        self.tenant_queue_wait = prom.Histogram(
            "tenant_queue_wait_seconds",
            "Time from arrival at the ledger to its decision, by tenant and outcome.",
            ["tenant", "outcome"],
            buckets=WAIT_BUCKETS,
            **common,
        )
        self.peak_ratio = prom.Histogram(
            "peak_estimate_ratio",
            "Measured peak bytes / estimated bytes, as reported by the endpoint.",
            ["device"],
            buckets=PEAK_RATIO_BUCKETS,
            **common,
        )
        self.reserved_output_share = prom.Histogram(
            "reserved_output_share",
            "Learned lengths: new tokens reserved / the request's declared limit (1: the worst case).",
            buckets=RESERVED_SHARE_BUCKETS,
            **common,
        )
        self.grown = prom.Counter(
            "reservation_grown_bytes", "Bytes reservations grew by as answers ran past their prediction.", **common
        )
        self._gauges: dict[str, Any] = {}
        self._refresher: asyncio.Task[None] | None = None
        if self.multiprocess:
            for name, help_text, labels, mode in (*LEDGER_GAUGES, *TENANT_GAUGES, *DEVICE_GAUGES):
                if mode == "ledger":
                    mode = "livemax" if shared_ledger else "livesum"
                self._gauges[name] = prom.Gauge(name, help_text, labels, multiprocess_mode=mode, **common)
        else:
            self.registry.register(_StateCollector(self))
        self._children: dict[tuple[str, ...], Any] = {}
        self._tenants_seen = False  # the ledger has reported a tenant: sample every tenant label from now on

    def __repr__(self) -> str:
        mode = "multiprocess" if self.multiprocess else "single process"
        return f"<GPUMetrics {self.namespace}_* ({mode})>"

    # -- called by the middleware (cheap: cached label children) -----------------------------

    def _child(self, metric: Any, kind: str, *labels: str) -> Any:
        key = (kind, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def record_decision(
        self, outcome: str, *, device: str | None, reason: str | None, wait_seconds: float, tenant: str | None = None
    ) -> None:
        """``tenant`` is the bounded label (:func:`tenant_label`), or None when tenants are off."""
        self._child(self.queue_wait, "wait", outcome).observe(wait_seconds)
        if outcome == ADMITTED:
            self._child(self.admitted, "admitted", device or "").inc()
        elif reason is not None:
            self._child(self.rejected, "rejected", reason).inc()
        if tenant is not None:
            self._child(self.tenant_queue_wait, "tenant_wait", tenant, outcome).observe(wait_seconds)
            if outcome == ADMITTED:
                self._child(self.tenant_admitted, "tenant_admitted", tenant).inc()
            elif reason is not None:
                self._child(self.tenant_rejected, "tenant_rejected", tenant, reason).inc()

    def record_misprediction(self) -> None:
        """A ``queue-timeout`` of a request the deadline rule let queue: its prediction was wrong."""
        self.mispredicted.inc()

    def record_rejection(self, reason: str) -> None:
        """A request answered before it reached the ledger (body errors)."""
        self._child(self.rejected, "rejected", reason).inc()

    def record_clamp(self) -> None:
        self.clamped.inc()

    def record_peak(self, device: str, estimated_bytes: int, actual_bytes: int) -> None:
        if estimated_bytes > 0:
            self._child(self.peak_ratio, "peak", device).observe(actual_bytes / estimated_bytes)

    def record_learned(self, reserved_tokens: int, max_new_tokens: int) -> None:
        """A request admitted on a learned length: how much of its limit it reserved."""
        if max_new_tokens > 0:
            self.reserved_output_share.observe(reserved_tokens / max_new_tokens)

    def record_growth(self, nbytes: int) -> None:
        if nbytes > 0:
            self.grown.inc(nbytes)

    # -- state gauges --------------------------------------------------------------------------

    def gauge_samples(self) -> Iterator[tuple[str, str, tuple[str, ...], list[tuple[tuple[str, ...], float]]]]:
        """(name, help, labels, [(label values, value)]) for every state gauge, read now."""
        values: dict[str, list[tuple[tuple[str, ...], float]]] = {}
        if self.ledger is not None:
            stats = self.ledger.statistics()
            values["queue_depth"] = [((), stats.waiting)]
            values["queue_bytes"] = [((), stats.waiting_bytes)]
            values["in_flight_requests"] = [((d.name,), d.in_flight) for d in stats.devices]
            values["reserved_bytes"] = [((d.name,), d.reserved_bytes) for d in stats.devices]
            values["capacity_bytes"] = [((d.name,), d.capacity_bytes) for d in stats.devices]
            values["ledger_failovers"] = [((), stats.failovers)]
            values.update(self._tenant_samples(stats))
        if self.sampler is not None:
            snapshot = self.sampler.snapshot
            fields = {
                "device_memory_used_bytes": "memory_used_bytes",
                "device_memory_total_bytes": "memory_total_bytes",
                "device_temperature_celsius": "temperature_celsius",
                "device_utilization_ratio": "utilization_ratio",
            }
            for metric, attribute in fields.items():
                values[metric] = [
                    ((name,), value)
                    for name, reading in snapshot.readings.items()
                    if (value := getattr(reading, attribute)) is not None
                ]
            fresh = snapshot.fresh(self.sampler.clock(), 3 * self.sampler.interval)
            values["device_probe_up"] = [((), 1.0 if fresh else 0.0)]
        for name, help_text, labels, _ in (*LEDGER_GAUGES, *TENANT_GAUGES, *DEVICE_GAUGES):
            if name in values:
                yield name, help_text, labels, values[name]

    def _tenant_samples(self, stats: LedgerStatistics) -> dict[str, list[tuple[tuple[str, ...], float]]]:
        """The per-tenant gauges, tenants not named in advance summed under ``other``.

        Once the ledger has reported a tenant, every label is sampled every time, 0 when nobody
        holds or waits under it: in multiprocess mode a label left out would keep its last value.
        """
        if not stats.tenants and not self._tenants_seen:
            return {}
        self._tenants_seen = True
        # label -> [reserved, waiting, served, weight of those holding or waiting]
        labels = (*self.tenant_labels, DEFAULT_TENANT, OTHER_TENANT_LABEL)
        sums: dict[str, list[float]] = {label: [0.0, 0.0, 0.0, 0.0] for label in labels}
        for t in stats.tenants:
            row = sums[tenant_label(t.name, self.tenant_labels)]
            row[0] += t.reserved_bytes
            row[1] += t.waiting
            row[2] += t.served_byte_seconds
            if t.in_flight or t.waiting:
                row[3] += t.weight
        reserved = sum(row[0] for row in sums.values())
        weights = sum(row[3] for row in sums.values())
        samples: dict[str, list[tuple[tuple[str, ...], float]]] = {name: [] for name, *_ in TENANT_GAUGES}
        for label, (held, waiting, served, weight) in sums.items():
            samples["tenant_reserved_bytes"].append(((label,), held))
            samples["tenant_waiting_requests"].append(((label,), waiting))
            samples["tenant_served_byte_seconds"].append(((label,), served))
            samples["tenant_weight_share_ratio"].append(((label,), weight / weights if weights else 0.0))
            samples["tenant_reserved_share_ratio"].append(((label,), held / reserved if reserved else 0.0))
        return samples

    def refresh(self) -> None:
        """Multiprocess mode: copy the current state into this worker's gauges (on the event loop)."""
        for name, _, _, samples in self.gauge_samples():
            gauge = self._gauges[name]
            for labels, value in samples:
                (gauge.labels(*labels) if labels else gauge).set(value)

    def ensure_refreshing(self) -> None:
        """Multiprocess mode: keep one refresh task running on the current loop. Cheap to call often."""
        if not self.multiprocess:
            return
        loop = asyncio.get_running_loop()
        task = self._refresher
        if task is None or task.done() or task.get_loop() is not loop:
            self._refresher = loop.create_task(self._refresh_forever(), name="gpu_asgi-metrics-refresh")

    async def _refresh_forever(self) -> None:
        while True:
            self.refresh()
            await asyncio.sleep(self.refresh_interval)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition body and its content type (OpenMetrics when ``accept`` asks for it).

        Single-process mode reads the ledger: call it on the event loop. Multiprocess mode only
        reads files: call :meth:`refresh` on the loop first, then this anywhere.
        """
        prom = _prometheus()
        from prometheus_client.exposition import choose_encoder

        registry = self.registry
        if self.multiprocess:
            from prometheus_client import multiprocess

            registry = prom.CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        encoder, content_type = choose_encoder(accept or "")
        return encoder(registry), content_type

    def close(self) -> None:
        """Stop refreshing; in multiprocess mode also drop this process's live gauges (on shutdown)."""
        if self._refresher is not None:
            self._refresher.cancel()
            self._refresher = None
        if self.multiprocess:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]


class _StateCollector:
    """Reads the state gauges at scrape time (single-process mode)."""

    def __init__(self, metrics: GPUMetrics) -> None:
        from prometheus_client.core import GaugeMetricFamily

        self._metrics = metrics
        self._family = GaugeMetricFamily

    def describe(self) -> list[Any]:
        return []  # names are fixed and prefixed: nothing to check, and no ledger read at registration

    def collect(self) -> Iterator[Any]:
        prefix = self._metrics.namespace + "_"
        for name, help_text, labels, samples in self._metrics.gauge_samples():
            family = self._family(prefix + name, help_text, labels=list(labels))
            for label_values, value in samples:
                family.add_metric(list(label_values), value)
            yield family
