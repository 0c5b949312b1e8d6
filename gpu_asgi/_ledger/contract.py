"""The contract every budget ledger shares, and the middleware relies on.

The :class:`BudgetLedger` protocol, the :class:`Reservation` it hands out, the statistics
snapshots it returns, the priority range and check, and the defaults both ledgers take. The
in-process :class:`~gpu_asgi.Ledger` (``_ledger``) and the Redis one (``redis_ledger``) implement
it; the middleware, health and metrics use only this. Named ``_ledger_contract`` rather than after
one class because it holds the whole interface, and it sits beside ``_ledger`` and ``_ledger_url``.
It imports no ledger.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from .tenants import DEFAULT_TENANT, TenantPolicy, TenantStatistics

DEFAULT_DEVICE = "cuda:0"
DEFAULT_MAX_QUEUE = 256
DEFAULT_MAX_WAIT = 30.0
DEFAULT_MAX_BYPASS = 8
#: Priorities are integers in this range in every ledger (the Redis ledger's queue scores need it).
MIN_PRIORITY = -4095
MAX_PRIORITY = 4095
#: Timeouts at or above this many seconds (``inf`` included) mean "no timeout".
MAX_TIMEOUT = 1e9


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
    #: Tenants with bytes held or waiting, and every configured one.
    tenants: tuple[TenantStatistics, ...] = ()

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
    """What the middleware needs from a ledger: the in-process :class:`~gpu_asgi.Ledger` or a shared one.

    Implementations hand out :class:`Reservation` objects and receive their bytes back through
    ``_give_back``, called on the event loop exactly once per byte.
    """

    @property
    def devices(self) -> tuple[str, ...]: ...

    def try_reserve(
        self, nbytes: int, *, devices: Sequence[str] | None = None, tenant: str = DEFAULT_TENANT
    ) -> Reservation | None: ...

    async def reserve(
        self,
        nbytes: int,
        *,
        devices: Sequence[str] | None = None,
        priority: int = 0,
        timeout: float | None = None,
        tenant: str = DEFAULT_TENANT,
        wait_limit: float | None = None,
    ) -> Reservation: ...

    def retry_after(self, nbytes: int = 0, *, priority: int = 0, tenant: str = DEFAULT_TENANT) -> float: ...

    def tenant_policy(self, tenant: str) -> TenantPolicy: ...

    def statistics(self) -> LedgerStatistics: ...

    def _give_back(self, reservation: Reservation, nbytes: int, *, finished: bool) -> None: ...


#: Makes a reservation's read-and-update of what it holds one step. ``shrink``/``release`` may run
#: on a worker thread while the loop releases the same reservation (the last chunk sent, the
#: endpoint returning): without it both could read the same bytes and give them back twice. One
#: lock for all: each holds it for a few attribute reads and writes, never across a call.
_HOLDING = threading.Lock()


class Reservation:
    """Bytes held on one device. Release is idempotent; the bytes return exactly once, from any
    thread."""

    __slots__ = ("_held", "_ledger", "_released", "device", "id", "requested_bytes", "tenant", "waited")

    def __init__(
        self, ledger: BudgetLedger, id: str, device: str, nbytes: int, waited: float, tenant: str = DEFAULT_TENANT
    ) -> None:
        self.id = id
        self.device = device
        self.tenant = tenant
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
        with _HOLDING:
            returned = max(0, self._held - nbytes)  # zero once released, since nothing is held then
            self._held -= returned
        if returned:
            self._ledger._give_back(self, returned, finished=False)
        return returned

    def release(self) -> int:
        """Return every byte still held; later calls return 0."""
        with _HOLDING:
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


def check_priority(priority: int) -> int:
    """The one priority check both ledgers (and ``gpu_bound``) make: an integer in range."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, got {priority!r}")
    return priority
