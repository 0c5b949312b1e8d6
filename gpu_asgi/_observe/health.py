"""``/health`` and ``/metrics`` as a mountable Starlette router.

``/health`` answers from the ledger's statistics and the sampler's last snapshot: no device call,
so it is safe for a liveness/readiness probe at any rate. Statuses:

- ``ok`` (200): admitting normally.
- ``degraded`` (200): still admitting, but a device is above the thermal threshold, the
  device probe fails or is stale (with a fail-open guard, or none), or the shared ledger is
  unreachable and this process admits from its local share.
- ``unavailable`` (503): new requests would be refused: the queue is full, the device guard fails
  closed and has no usable reading, a device is above ``unavailable_above_celsius``, the shared
  ledger is unreachable and fails closed, or the process is draining.

With a :class:`~gpu_asgi.Lifecycle`, the router also serves the Kubernetes probes: liveness
(``/health/live``: 200 while the event loop answers) and readiness (``/health/ready``: 200 only
when the app has marked itself ready, the process is not draining and ``/health`` is not
``unavailable``), and optionally a drain endpoint for a preStop hook.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from .._device.policy import DeviceGuard, ThermalPolicy
from .._device.probe import DeviceReading
from .._device.sampler import DeviceSampler
from .._estimate.lengths import OutputLengths
from .._ledger.contract import BudgetLedger
from .._ledger.legacy import as_budget_ledger
from .._lifecycle import Lifecycle
from .metrics import GPUMetrics

OK, DEGRADED, UNAVAILABLE = "ok", "degraded", "unavailable"


def health_report(
    ledger: BudgetLedger,
    *,
    sampler: DeviceSampler | None = None,
    thermal: ThermalPolicy | None = None,
    device_guard: DeviceGuard | None = None,
    lifecycle: Lifecycle | None = None,
    output_lengths: OutputLengths | None = None,
) -> dict[str, Any]:
    """The ``/health`` body. Call it on the event loop (it reads the ledger)."""
    ledger = as_budget_ledger(ledger)  # a ledger in an earlier release's shape is adapted
    return _report(ledger, sampler, thermal, device_guard, lifecycle, output_lengths)


def _report(
    ledger: BudgetLedger,
    sampler: DeviceSampler | None,
    thermal: ThermalPolicy | None,
    device_guard: DeviceGuard | None,
    lifecycle: Lifecycle | None,
    output_lengths: OutputLengths | None = None,
) -> dict[str, Any]:
    """:func:`health_report` of a ledger already adapted (the router adapts once, not per request)."""
    stats = ledger.statistics()
    degraded: list[str] = []
    unavailable: list[str] = []
    if lifecycle is not None and lifecycle.draining:
        unavailable.append("the process is draining: it admits no new GPU work")
    if stats.waiting >= ledger.max_queue:
        unavailable.append(f"the admission queue is full ({stats.waiting} waiting)")
    availability = ledger.availability
    if availability == "local":  # the shared (Redis) ledger did not answer
        degraded.append("the shared ledger is unreachable: admitting from this process's local share")
    elif availability == "unavailable":
        unavailable.append("the shared ledger is unreachable and admission fails closed (ledger-unavailable)")
    snapshot = sampler.snapshot if sampler is not None else None
    probe: dict[str, Any] | None = None
    if snapshot is not None and sampler is not None:
        now = sampler.clock()
        max_age = device_guard.max_age if device_guard is not None else 3 * sampler.interval
        usable = snapshot.fresh(now, max_age)
        age = snapshot.age(now)
        probe = {
            "kind": snapshot.probe,
            "ok": usable,
            "age_seconds": None if age is None else round(age, 3),
            "error": snapshot.error,
        }
        closed_guard = device_guard if device_guard is not None and device_guard.fails_closed else None
        if not usable:
            why = snapshot.error or f"the last reading is {age:.1f} s old"
            (unavailable if closed_guard is not None else degraded).append(
                f"the device probe has no usable reading: {why}"
            )
        elif closed_guard is not None:  # a fresh snapshot can still lack a device, or its free memory
            names = [device.name for device in stats.devices]
            missing = [(name, unreadable) for name in names if (unreadable := closed_guard.unreadable(name, snapshot, now))]
            if missing:  # the guard refuses these devices; when that is all of them, every request
                reasons = [f"the device guard cannot check {name}: {why}" for name, why in missing]
                (unavailable if len(missing) == len(names) else degraded).extend(reasons)
        if thermal is not None and usable:
            for name, reading in snapshot.readings.items():
                celsius = reading.temperature_celsius
                if celsius is None:
                    continue
                if thermal.unavailable_above_celsius is not None and celsius > thermal.unavailable_above_celsius:
                    unavailable.append(f"{name} is at {celsius:g} °C, above {thermal.unavailable_above_celsius:g}")
                elif celsius > thermal.degraded_above_celsius:
                    degraded.append(f"{name} is at {celsius:g} °C, above {thermal.degraded_above_celsius:g}")
    devices = []
    for device in stats.devices:
        probed = snapshot.readings.get(device.name) if snapshot is not None else None
        devices.append(
            {
                "name": device.name,
                "capacity_bytes": device.capacity_bytes,
                "reserved_bytes": device.reserved_bytes,
                "free_bytes": device.free_bytes,
                "in_flight": device.in_flight,
                "probe": None if probed is None else _reading(probed),
            }
        )
    status = UNAVAILABLE if unavailable else DEGRADED if degraded else OK
    return {
        "status": status,
        "reasons": unavailable + degraded,
        "waiting": stats.waiting,
        "waiting_bytes": stats.waiting_bytes,
        "in_flight": stats.in_flight,
        "admitted_total": stats.admitted_total,
        "rejected_total": dict(stats.rejected_total),
        "devices": devices,
        "probe": probe,
        **({} if lifecycle is None else {"ready": lifecycle.ready, "draining": lifecycle.draining}),
        **({} if output_lengths is None else {"output_lengths": [asdict(row) for row in output_lengths.statistics()]}),
    }


def _reading(reading: DeviceReading) -> dict[str, Any]:
    return {
        "memory_total_bytes": reading.memory_total_bytes,
        "memory_used_bytes": reading.memory_used_bytes,
        "memory_free_bytes": reading.memory_free_bytes,
        "reclaimable_bytes": reading.reclaimable_bytes,
        "temperature_celsius": reading.temperature_celsius,
        "utilization_ratio": reading.utilization_ratio,
    }


def health_router(
    ledger: BudgetLedger,
    *,
    sampler: DeviceSampler | None = None,
    thermal: ThermalPolicy | None = None,
    device_guard: DeviceGuard | None = None,
    metrics: GPUMetrics | None = None,
    health_path: str = "/health",
    metrics_path: str = "/metrics",
    lifecycle: Lifecycle | None = None,
    live_path: str = "/health/live",
    ready_path: str = "/health/ready",
    drain_path: str | None = None,
    output_lengths: OutputLengths | None = None,
) -> Router:
    """A router with ``GET health_path`` and, when ``metrics`` is given, ``GET metrics_path``.

    With ``lifecycle`` (the one given to the middleware), also ``GET live_path`` and
    ``GET ready_path``, and with ``drain_path`` a ``GET``/``POST`` that starts the drain for a
    Kubernetes preStop hook (``?wait=S``: answer once admitted requests have ended, at most S
    seconds); keep that one off the public network.

    Mount it (``app.mount("/ops", health_router(...))``) or add its routes at the top level
    (``app.router.routes.extend(health_router(...).routes)``). Pass the same ledger, sampler,
    thermal policy, guard and ``output_lengths`` as to the middleware (the last shows what it learnt).
    """
    ledger = as_budget_ledger(ledger)

    def report() -> dict[str, Any]:
        if sampler is not None:
            sampler.ensure_started()
        if metrics is not None:
            metrics.ensure_refreshing()
        return _report(ledger, sampler, thermal, device_guard, lifecycle, output_lengths)

    async def health(request: Request) -> Response:
        body = report()
        status = 503 if body["status"] == UNAVAILABLE else 200
        return JSONResponse(body, status_code=status, headers=_NO_STORE)

    routes = [Route(health_path, health, methods=["GET"], name="gpu_asgi_health")]
    if lifecycle is not None:
        routes.extend(_lifecycle_routes(lifecycle, report, live_path, ready_path, drain_path))
    if metrics is not None:

        async def metrics_endpoint(request: Request) -> Response:
            accept = request.headers.get("accept")
            source = sampler if sampler is not None else metrics.sampler
            if source is not None:
                source.ensure_started()
            if metrics.multiprocess:
                metrics.ensure_refreshing()
                metrics.refresh()  # this worker's state is current; the others refresh on their own
                body, content_type = await asyncio.to_thread(metrics.render, accept)
            else:
                body, content_type = metrics.render(accept)  # reads the ledger: stays on the loop
            return Response(body, media_type=content_type, headers=_NO_STORE)

        routes.append(Route(metrics_path, metrics_endpoint, methods=["GET"], name="gpu_asgi_metrics"))
    return Router(routes=routes)


_NO_STORE = {"cache-control": "no-store"}


def _lifecycle_routes(
    lifecycle: Lifecycle, report: Callable[[], dict[str, Any]], live_path: str, ready_path: str, drain_path: str | None
) -> list[Route]:
    """Liveness, readiness and (optionally) the preStop drain."""

    async def live(request: Request) -> Response:
        # Answered by the event loop itself: a loop blocked or dead does not answer at all.
        return JSONResponse({"status": "live"}, headers=_NO_STORE)

    async def ready(request: Request) -> Response:
        body = report()
        reasons = list(body["reasons"]) if body["status"] == UNAVAILABLE else []
        if not lifecycle.app_ready:
            reasons.insert(0, "the app has not marked itself ready (Lifecycle.mark_ready)")
        ok = not reasons
        answer = {"status": "ready" if ok else "not-ready", "reasons": reasons, "draining": lifecycle.draining}
        return JSONResponse(answer, status_code=200 if ok else 503, headers=_NO_STORE)

    routes = [
        Route(live_path, live, methods=["GET"], name="gpu_asgi_live"),
        Route(ready_path, ready, methods=["GET"], name="gpu_asgi_ready"),
    ]
    if drain_path is not None:

        async def drain(request: Request) -> Response:
            raw = request.query_params.get("wait", "0")
            try:
                wait = float(raw)
            except ValueError:
                wait = math.nan
            if not 0 <= wait < math.inf:
                return JSONResponse({"detail": f"wait must be a number of seconds >= 0, got {raw!r}"}, status_code=400)
            if wait:
                await lifecycle.drain(wait)
            else:
                lifecycle.start_draining()
            body = {"draining": True, "in_flight": lifecycle.in_flight}
            return JSONResponse(body, status_code=200 if lifecycle.in_flight == 0 else 202, headers=_NO_STORE)

        routes.append(Route(drain_path, drain, methods=["GET", "POST"], name="gpu_asgi_drain"))
    return routes
