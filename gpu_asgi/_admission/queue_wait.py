"""Reserving an admitted request's bytes: at once, or queued while listening for a disconnect,
with the device guard's checks before and after; the queue-wait span ends and the decision is
counted here, whatever the outcome."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from opentelemetry.trace import Span

from .._asgi.routes import RouteSpec
from .._errors import GPUAdmissionError, QueueTimeout
from .._ledger.contract import BudgetLedger, Reservation
from .._ledger.tenants import DEFAULT_TENANT
from .._observe import tracing as otel
from .._types import Message, Receive

if TYPE_CHECKING:
    from .._asgi.middleware import GPUAdmissionMiddleware
    from .._observe.lifecycle import Lifecycle


async def reserve(
    middleware: GPUAdmissionMiddleware,
    span: Span,
    nbytes: int,
    spec: RouteSpec,
    receive: Receive,
    wait_limit: float | None,
    tenant: str = DEFAULT_TENANT,
    label: str | None = None,
) -> tuple[Reservation | None, asyncio.Future[Message] | None]:
    """Reserve (or queue for) the bytes for ``tenant`` on ``middleware``'s ledger, then ask its
    device guard, if any.

    ``label`` is the tenant as metrics name it (None: tenants are off).

    Returns what :func:`wait` returns, or raises the rejection. Whatever happens, the
    queue-wait span ends and the decision is counted in ``finally``.
    """
    outcome, reason, device, depth, started = otel.CANCELLED, None, None, 0, 0.0
    pending: asyncio.Future[Message] | None = None
    try:
        if middleware.lifecycle.draining:  # stopping while this request's body was read
            raise middleware.lifecycle.refusal()
        devices = spec.devices if middleware.device_guard is None else trusted_devices(middleware, spec, nbytes, tenant)
        reservation = await middleware.ledger.reserve_if_free(nbytes, devices=devices, tenant=tenant)
        if reservation is None:
            # The deadline decision is the ledger's, at the moment it finds the request must queue.
            # Requests whose reserve() task has not run yet are not in the ledger's count: ours covers them.
            depth = max(middleware.ledger.statistics().waiting, middleware._queued)
            middleware._queued += 1
            started = time.perf_counter()
            reservation, pending = await wait(
                middleware.ledger, nbytes, devices, spec.priority, receive, wait_limit, tenant, middleware.lifecycle
            )
            if reservation is None:
                outcome = otel.DISCONNECTED
                return None, None
            if middleware.device_guard is not None:  # readings may have changed while it waited
                check_device(middleware, reservation, nbytes, tenant)
        device = reservation.device
        outcome = otel.ADMITTED
        return reservation, pending
    except GPUAdmissionError as error:
        outcome = otel.TIMED_OUT if isinstance(error, QueueTimeout) else otel.REJECTED
        reason = error.reason
        if pending is not None:
            pending.cancel()
        raise
    finally:
        waited = 0.0
        if started:
            middleware._queued -= 1
            waited = time.perf_counter() - started
        otel.end_queue_wait(span, outcome, device=device, queue_depth=depth, wait_seconds=waited, reason=reason)
        if middleware.metrics is not None:
            middleware.metrics.record_decision(outcome, device=device, reason=reason, wait_seconds=waited, tenant=label)


def trusted_devices(middleware: GPUAdmissionMiddleware, spec: RouteSpec, nbytes: int, tenant: str) -> tuple[str, ...]:
    """Trust the device: the route's devices whose sampled free memory can take ``nbytes``.

    The ledger then places the request only on those, so a device that another process has
    filled is passed over rather than refused. With none left, the first refusal is raised.
    """
    guard, sampler, ledger = middleware.device_guard, middleware.sampler, middleware.ledger
    assert guard is not None and sampler is not None
    snapshot, now = sampler.snapshot, sampler.clock()
    trusted, refusal = [], None
    for device in spec.devices or ledger.devices:
        error = guard.refusal(device, nbytes, snapshot, now)
        if error is None:
            trusted.append(device)
        elif refusal is None:
            refusal = error
    # None trusted, or only a guarded-off device could hold the bytes: a shortage for now (503
    # with Retry-After), never the ledger's "waiting cannot help" (413) about the rest.
    every = spec.devices or ledger.devices
    if refusal is not None and (not trusted or _largest(ledger, trusted) < nbytes <= _largest(ledger, every)):
        refusal.retry_after = ledger.retry_after(nbytes, tenant=tenant)
        raise refusal
    return tuple(trusted)


def check_device(middleware: GPUAdmissionMiddleware, reservation: Reservation, nbytes: int, tenant: str) -> None:
    """After a wait in the queue: give the bytes back and refuse when the granted device's
    sampled free memory has fallen too low meanwhile."""
    guard, sampler = middleware.device_guard, middleware.sampler
    assert guard is not None and sampler is not None
    error = guard.refusal(reservation.device, nbytes, sampler.snapshot, sampler.clock())
    if error is not None:
        reservation.release()
        error.retry_after = middleware.ledger.retry_after(nbytes, tenant=tenant)
        raise error


async def wait(
    ledger: BudgetLedger,
    nbytes: int,
    devices: tuple[str, ...] | None,
    priority: int,
    receive: Receive,
    deadline: float | None = None,
    tenant: str = DEFAULT_TENANT,
    lifecycle: Lifecycle | None = None,
) -> tuple[Reservation | None, asyncio.Future[Message] | None]:
    """Queue for the bytes while listening for a disconnect (``deadline``: the ledger may
    refuse at once, :class:`DeadlineUnmeetable`) and, with ``lifecycle``, for a drain
    (:class:`ShuttingDown` at once).

    Returns the reservation and the still-pending ``receive()`` (handed on to the endpoint so
    no message is lost), or ``(None, None)`` when the client disconnected first.
    """
    reserving = asyncio.ensure_future(
        ledger.reserve(nbytes, devices=devices, priority=priority, tenant=tenant, deadline=deadline)
    )
    listening: asyncio.Future[Message] = asyncio.ensure_future(receive())
    stopping = lifecycle.queued() if lifecycle is not None else asyncio.get_running_loop().create_future()
    try:
        while True:
            await asyncio.wait((reserving, listening, stopping), return_when=asyncio.FIRST_COMPLETED)
            if reserving.done():
                return reserving.result(), listening  # raises the ledger's rejection, if any
            if stopping.done() and lifecycle is not None:  # draining: leave the queue now
                reserving.cancel()
                outcome = (await asyncio.gather(reserving, return_exceptions=True))[0]
                if isinstance(outcome, Reservation):
                    outcome.release()
                raise lifecycle.refusal()
            if listening.result()["type"] == "http.disconnect":
                reserving.cancel()
                outcome = (await asyncio.gather(reserving, return_exceptions=True))[0]
                if isinstance(outcome, Reservation):
                    outcome.release()  # granted in the same instant: give it straight back
                return None, None
            listening = asyncio.ensure_future(receive())  # not a disconnect: keep listening
    except BaseException:
        listening.cancel()
        if not reserving.done():
            reserving.cancel()
        elif not reserving.cancelled() and isinstance(granted := reserving.exception() or reserving.result(), Reservation):
            granted.release()  # we were cancelled just as the bytes were granted
        raise
    finally:
        if lifecycle is not None:
            lifecycle.dequeued(stopping)


def _largest(ledger: BudgetLedger, devices: Sequence[str]) -> int:
    """The largest budget among ``devices``."""
    return max(d.capacity_bytes for d in ledger.statistics().devices if d.name in devices)
