"""The in-process byte ledger: one VRAM budget per device, reservations, a bounded fair queue.

Admission is FIFO by priority. When the request at the head does not fit, later requests that
do fit may pass it, but at most ``max_bypass`` times; after that nothing is admitted until the
head fits, so a large request is delayed by a bounded amount and never starved. All state is
touched only from the event loop, so check-and-reserve is atomic without locks.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ._errors import NeverFits, QueueFull, QueueTimeout

DEFAULT_DEVICE = "cuda:0"
DEFAULT_MAX_QUEUE = 256
DEFAULT_MAX_WAIT = 30.0
DEFAULT_MAX_BYPASS = 8
#: Releases observed over this many seconds give the drain rate behind ``Retry-After``.
RATE_WINDOW = 30.0
MAX_RETRY_AFTER = 600.0


@dataclass(frozen=True, slots=True)
class DeviceStatistics:
    name: str
    capacity_bytes: int
    reserved_bytes: int
    in_flight: int

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.reserved_bytes


@dataclass(frozen=True, slots=True)
class LedgerStatistics:
    """A snapshot for ``/health`` and metrics."""

    devices: tuple[DeviceStatistics, ...]
    waiting: int
    waiting_bytes: int
    admitted_total: int
    rejected_total: Mapping[str, int] = field(default_factory=dict)
    release_rate_bytes_per_second: float = 0.0

    @property
    def in_flight(self) -> int:
        return sum(device.in_flight for device in self.devices)

    @property
    def capacity_bytes(self) -> int:
        return sum(device.capacity_bytes for device in self.devices)

    @property
    def reserved_bytes(self) -> int:
        return sum(device.reserved_bytes for device in self.devices)


@runtime_checkable
class BudgetLedger(Protocol):
    """What the middleware needs from a ledger: the in-process :class:`Ledger` or a shared one.

    Implementations hand out :class:`Reservation` objects and receive their bytes back through
    ``_give_back``, called on the event loop exactly once per byte.
    """

    @property
    def devices(self) -> tuple[str, ...]: ...

    def try_reserve(self, nbytes: int, *, devices: Sequence[str] | None = None) -> Reservation | None: ...

    async def reserve(
        self, nbytes: int, *, devices: Sequence[str] | None = None, priority: int = 0, timeout: float | None = None
    ) -> Reservation: ...

    def retry_after(self, nbytes: int = 0) -> float: ...

    def statistics(self) -> LedgerStatistics: ...

    def _give_back(self, reservation: Reservation, nbytes: int, *, finished: bool) -> None: ...


class Reservation:
    """Bytes held on one device. Release is idempotent; the bytes return exactly once."""

    __slots__ = ("_held", "_ledger", "_released", "device", "id", "requested_bytes", "waited")

    def __init__(self, ledger: BudgetLedger, id: str, device: str, nbytes: int, waited: float) -> None:
        self.id = id
        self.device = device
        self.requested_bytes = nbytes
        #: Seconds spent in the queue before admission.
        self.waited = waited
        self._held = nbytes
        self._released = False
        self._ledger = ledger

    @property
    def nbytes(self) -> int:
        """Bytes held now (less than requested after :meth:`shrink`)."""
        return self._held

    @property
    def released(self) -> bool:
        return self._released

    def shrink(self, nbytes: int) -> int:
        """Keep only ``nbytes`` (e.g. once outputs are on the host); returns the bytes given back."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        returned = max(0, self._held - nbytes)
        if returned:  # zero once released, since nothing is held then
            self._held -= returned
            self._ledger._give_back(self, returned, finished=False)
        return returned

    def release(self) -> int:
        """Return every byte still held; later calls return 0."""
        if self._released:
            return 0
        self._released = True
        returned, self._held = self._held, 0
        self._ledger._give_back(self, returned, finished=True)
        return returned

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else f"{self._held} bytes"
        return f"<Reservation {self.id} on {self.device}: {state}>"


class _Device:
    __slots__ = ("capacity", "in_flight", "name", "reserved")

    def __init__(self, name: str, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"device {name!r} needs a positive byte capacity, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.reserved = 0
        self.in_flight = 0


class _Waiter:
    __slots__ = ("bypassed", "devices", "future", "nbytes", "priority", "seq", "since")

    def __init__(self, seq: int, nbytes: int, devices: tuple[_Device, ...], priority: int, since: float) -> None:
        self.seq = seq
        self.nbytes = nbytes
        self.devices = devices
        self.priority = priority
        self.future: asyncio.Future[Reservation] = asyncio.get_running_loop().create_future()
        #: How often a later request was admitted while this one headed the queue and did not fit.
        self.bypassed = 0
        self.since = since


class Ledger:
    """Byte budgets for one or more devices, shared by every request of this process.

    ``capacity`` is the budget in bytes for a single device (named ``"cuda:0"``) or a mapping
    of device name to budget. Derive budgets with :func:`budget_bytes`: weights and runtime
    overhead come off once there, never per request.
    """

    def __init__(
        self,
        capacity: int | Mapping[str, int],
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_wait: float = DEFAULT_MAX_WAIT,
        max_bypass: int = DEFAULT_MAX_BYPASS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        capacities = {DEFAULT_DEVICE: capacity} if isinstance(capacity, int) else dict(capacity)
        if not capacities:
            raise ValueError("a ledger needs at least one device")
        self._devices = {name: _Device(name, nbytes) for name, nbytes in capacities.items()}
        self._all = tuple(self._devices.values())
        self._largest = max(device.capacity for device in self._all)
        self.max_queue = max_queue
        self.max_wait = max_wait
        self.max_bypass = max_bypass
        self._clock = clock
        self._queues: dict[int, dict[int, _Waiter]] = {}  # priority -> seq -> waiter, insertion ordered
        self._waiting = 0
        self._waiting_bytes = 0
        self._ids = itertools.count(1)
        self._admitted = 0
        self._rejected: dict[str, int] = {}
        self._releases: deque[tuple[float, int]] = deque()
        self._released_in_window = 0

    def __repr__(self) -> str:
        budgets = ", ".join(f"{d.name}={d.capacity}" for d in self._all)
        return f"Ledger({budgets}, max_queue={self.max_queue}, max_wait={self.max_wait}, max_bypass={self.max_bypass})"

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(self._devices)

    def capacity(self, device: str = DEFAULT_DEVICE) -> int:
        return self._devices[device].capacity

    # -- admission ----------------------------------------------------------------------

    def try_reserve(self, nbytes: int, *, devices: Sequence[str] | None = None) -> Reservation | None:
        """Reserve at once if nobody is queued and the bytes fit; never waits, never queues."""
        allowed = self._allowed(devices, nbytes)
        if self._waiting:
            return None
        device = _place(nbytes, allowed)
        return None if device is None else self._grant(device, nbytes, 0.0)

    async def reserve(
        self,
        nbytes: int,
        *,
        devices: Sequence[str] | None = None,
        priority: int = 0,
        timeout: float | None = None,
    ) -> Reservation:
        """Reserve ``nbytes`` on one of ``devices``, waiting in the queue if they do not fit yet.

        Raises :class:`NeverFits` at once when no allowed device could ever hold the bytes,
        :class:`QueueFull` when the queue is at ``max_queue``, and :class:`QueueTimeout` after
        ``timeout`` (default ``max_wait``) seconds. Cancelling the caller leaves the queue cleanly,
        and bytes granted in the same instant are passed on, never leaked.
        """
        allowed = self._allowed(devices, nbytes)
        if not self._waiting:
            device = _place(nbytes, allowed)
            if device is not None:
                return self._grant(device, nbytes, 0.0)
        if self._waiting >= self.max_queue:
            self._count_rejection(QueueFull.reason)
            raise QueueFull(
                f"{self._waiting} requests are already waiting for GPU memory.",
                retry_after=self.retry_after(nbytes),
            )
        waiter = _Waiter(next(self._ids), nbytes, allowed, priority, self._clock())
        self._queues.setdefault(priority, {})[waiter.seq] = waiter
        self._waiting += 1
        self._waiting_bytes += nbytes
        self._dispatch()
        if waiter.future.done():
            return waiter.future.result()
        wait = self.max_wait if timeout is None else timeout
        try:
            async with asyncio.timeout(wait):
                return await waiter.future
        except BaseException as exc:
            if waiter.future.done() and not waiter.future.cancelled():
                waiter.future.result().release()  # granted as we were cancelled: pass the bytes on
            else:
                self._dequeue(waiter)
                self._dispatch()  # the one that left may have blocked the head
            if isinstance(exc, TimeoutError):
                self._count_rejection(QueueTimeout.reason)
                raise QueueTimeout(
                    f"No GPU memory became free for {nbytes} bytes within {wait:g} s.",
                    retry_after=self.retry_after(nbytes),
                ) from None
            raise

    def _allowed(self, devices: Sequence[str] | None, nbytes: int) -> tuple[_Device, ...]:
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        if devices is None:
            if nbytes <= self._largest:  # the common case, without a generator per request
                return self._all
            allowed = self._all
        else:
            try:
                allowed = tuple(self._devices[name] for name in devices)
            except KeyError as exc:
                raise ValueError(f"unknown device {exc.args[0]!r}; the ledger has {self.devices}") from None
        largest = max(device.capacity for device in allowed)
        if nbytes > largest:
            self._count_rejection(NeverFits.reason)
            raise NeverFits(
                f"The request needs {nbytes} bytes of GPU memory; the largest budget is {largest} bytes.",
                required_bytes=nbytes,
                budget_bytes=largest,
            )
        return allowed

    def _grant(self, device: _Device, nbytes: int, waited: float) -> Reservation:
        device.reserved += nbytes
        device.in_flight += 1
        self._admitted += 1
        return Reservation(self, f"r{next(self._ids)}", device.name, nbytes, waited)

    def _dispatch(self) -> None:
        """Admit waiters in order; later ones pass a head that does not fit at most ``max_bypass`` times."""
        if not self._waiting:
            return
        blocked: _Waiter | None = None
        for waiter in list(self._ordered()):
            if waiter.future.done():  # cancelled, its task has not run its cleanup yet
                self._dequeue(waiter)
                continue
            device = _place(waiter.nbytes, waiter.devices)
            if device is None:
                if blocked is None:
                    blocked = waiter
                continue
            if blocked is not None:
                if blocked.bypassed >= self.max_bypass:
                    return
                blocked.bypassed += 1
            self._dequeue(waiter)
            waiter.future.set_result(self._grant(device, waiter.nbytes, self._clock() - waiter.since))

    def _ordered(self) -> Iterator[_Waiter]:
        for priority in sorted(self._queues, reverse=True):
            yield from self._queues[priority].values()

    def _dequeue(self, waiter: _Waiter) -> None:
        queue = self._queues.get(waiter.priority)
        if queue is None or queue.pop(waiter.seq, None) is None:
            return
        if not queue:
            del self._queues[waiter.priority]
        self._waiting -= 1
        self._waiting_bytes -= waiter.nbytes

    def _give_back(self, reservation: Reservation, nbytes: int, *, finished: bool) -> None:
        device = self._devices[reservation.device]
        device.reserved -= nbytes
        if finished:
            device.in_flight -= 1
        if nbytes:
            now = self._clock()
            self._releases.append((now, nbytes))
            self._released_in_window += nbytes
            self._trim_releases(now)  # keeps the window bounded even if nobody asks for the rate
        self._dispatch()

    # -- rates and statistics -------------------------------------------------------------

    def _count_rejection(self, reason: str) -> None:
        self._rejected[reason] = self._rejected.get(reason, 0) + 1

    def release_rate(self) -> float:
        """Bytes per second given back over the last ``RATE_WINDOW`` seconds."""
        now = self._clock()
        self._trim_releases(now)
        if not self._releases:
            return 0.0
        return self._released_in_window / max(now - self._releases[0][0], 1.0)

    def _trim_releases(self, now: float) -> None:
        releases = self._releases
        while releases and releases[0][0] < now - RATE_WINDOW:
            self._released_in_window -= releases.popleft()[1]

    def retry_after(self, nbytes: int = 0) -> float:
        """Seconds until ``nbytes`` would likely fit behind the queue, from the observed drain rate.

        With no release observed yet there is no rate to go by; ``max_wait`` is then the hint.
        """
        rate = self.release_rate()
        if rate <= 0:
            return self.max_wait
        free = sum(device.capacity - device.reserved for device in self._all)
        backlog = max(0, self._waiting_bytes + nbytes - free)
        return min(MAX_RETRY_AFTER, max(1.0, backlog / rate))

    def statistics(self) -> LedgerStatistics:
        return LedgerStatistics(
            devices=tuple(DeviceStatistics(d.name, d.capacity, d.reserved, d.in_flight) for d in self._all),
            waiting=self._waiting,
            waiting_bytes=self._waiting_bytes,
            admitted_total=self._admitted,
            rejected_total=dict(self._rejected),
            release_rate_bytes_per_second=self.release_rate(),
        )


def _place(nbytes: int, devices: tuple[_Device, ...]) -> _Device | None:
    """The allowed device with the most free bytes, if the request fits there."""
    best = max(devices, key=lambda d: d.capacity - d.reserved) if len(devices) > 1 else devices[0]
    return best if best.capacity - best.reserved >= nbytes else None
