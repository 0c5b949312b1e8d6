"""Waiting in the ledger's queue while listening for the client, and the device guard's checks
before and after the wait. Functions of the values they need; the gate calls them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from .._device.policy import DeviceGuard
from .._device.sampler import DeviceSampler
from .._ledger.contract import BudgetLedger, Reservation
from .._lifecycle import Lifecycle
from .._types import Message, Receive


async def wait(
    ledger: BudgetLedger,
    nbytes: int,
    *,
    devices: tuple[str, ...] | None,
    priority: int,
    receive: Receive,
    deadline: float | None,
    tenant: str,
    lifecycle: Lifecycle,
) -> Reservation | None:
    """Queue for the bytes while listening for a disconnect and for a drain; None when the client
    left first, :class:`ShuttingDown` at once when the process starts draining.

    The whole body has been read, so the next message a server sends is ``http.disconnect``:
    the listening ``receive()`` is cancelled once the bytes are granted (a server's ``receive``
    gives up nothing when cancelled, as Starlette's own disconnect listeners rely on). The
    ledger may refuse at once (``deadline``: :class:`DeadlineUnmeetable`) or later.
    """
    reserving = asyncio.ensure_future(
        ledger.reserve(nbytes, devices=devices, priority=priority, tenant=tenant, deadline=deadline)
    )
    listening: asyncio.Future[Message] = asyncio.ensure_future(receive())
    stopping = lifecycle.queued()
    try:
        while True:
            await asyncio.wait((reserving, listening, stopping), return_when=asyncio.FIRST_COMPLETED)
            if stopping.done() and not reserving.done():  # draining: leave the queue now
                await _withdraw(reserving)
                raise lifecycle.refusal()
            if listening.done() and listening.result()["type"] == "http.disconnect":
                await _withdraw(reserving)
                return None
            if reserving.done():
                return reserving.result()  # raises the ledger's rejection, if any
            listening = asyncio.ensure_future(receive())  # not a disconnect: keep listening
    except BaseException:
        if not reserving.done():
            reserving.cancel()
        elif not reserving.cancelled() and isinstance(granted := reserving.exception() or reserving.result(), Reservation):
            granted.release()  # we were cancelled just as the bytes were granted
        raise
    finally:
        listening.cancel()
        lifecycle.dequeued(stopping)


async def _withdraw(reserving: asyncio.Future[Reservation]) -> None:
    """Leave the queue: cancel the reserve, and give straight back bytes granted in the same instant."""
    reserving.cancel()
    outcome = (await asyncio.gather(reserving, return_exceptions=True))[0]
    if isinstance(outcome, Reservation):
        outcome.release()


def trusted_devices(
    guard: DeviceGuard, sampler: DeviceSampler, ledger: BudgetLedger, devices: tuple[str, ...] | None, nbytes: int,
    tenant: str,
) -> tuple[str, ...]:
    """Trust the device: those of ``devices`` (None: the ledger's) whose sampled free memory can
    take ``nbytes``.

    The ledger then places the request only on those, so a device that another process has
    filled is passed over rather than refused. With none left, the first refusal is raised.
    """
    snapshot, now = sampler.snapshot, sampler.clock()
    every = devices or ledger.devices
    trusted, refusal = [], None
    for device in every:
        error = guard.refusal(device, nbytes, snapshot, now)
        if error is None:
            trusted.append(device)
        elif refusal is None:
            refusal = error
    # None trusted, or only a guarded-off device could hold the bytes: a shortage for now (503
    # with Retry-After), never the ledger's "waiting cannot help" (413) about the rest.
    if refusal is not None and (not trusted or _largest(ledger, trusted) < nbytes <= _largest(ledger, every)):
        refusal.retry_after = ledger.retry_after(nbytes, tenant=tenant)
        raise refusal
    return tuple(trusted)


def check_device(
    guard: DeviceGuard, sampler: DeviceSampler, ledger: BudgetLedger, reservation: Reservation, nbytes: int, tenant: str
) -> None:
    """After a wait in the queue: give the bytes back and refuse when the granted device's
    sampled free memory has fallen too low meanwhile."""
    error = guard.refusal(reservation.device, nbytes, sampler.snapshot, sampler.clock())
    if error is not None:
        reservation.release()
        error.retry_after = ledger.retry_after(nbytes, tenant=tenant)
        raise error


def _largest(ledger: BudgetLedger, devices: Sequence[str]) -> int:
    """The largest budget among ``devices``."""
    return max(d.capacity_bytes for d in ledger.statistics().devices if d.name in devices)
