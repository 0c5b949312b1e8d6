"""The contract every budget ledger shares, and the middleware relies on.

The :class:`BudgetLedger` protocol, the :class:`Reservation` it hands out, the statistics
snapshots it returns, the priority range and check, and the defaults both ledgers take. The
in-process :class:`~gpu_asgi.Ledger` (``memory``) and the Redis one (``redis.ledger``) implement
it, and so may a user's own (docs/ledgers.md); the middleware, health and metrics use only this.
It imports no ledger.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from .tenants import DEFAULT_TENANT, TenantPolicy, TenantStatistics

DEFAULT_DEVICE = "cuda:0"
DEFAULT_MAX_QUEUE = 256
DEFAULT_MAX_WAIT = 30.0
DEFAULT_MAX_BYPASS = 8
#: Seconds a shared (Redis) ledger waits for one answer before the ledger counts as unavailable.
DEFAULT_REDIS_TIMEOUT = 1.0
#: Priorities are integers in this range in every ledger (the Redis ledger's queue scores need it).
MIN_PRIORITY = -4095
MAX_PRIORITY = 4095
#: Waits at or above this many seconds (``inf`` included) mean "no limit".
MAX_TIMEOUT = 1e9

#: ``BudgetLedger.availability``: deciding as configured; deciding from this process's share of
#: the budget alone (a shared ledger's store is unreachable: ``/health`` says degraded); or
#: refusing every request (``LedgerUnavailable``, 503).
Availability = Literal["available", "local", "unavailable"]


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
    #: The shared ledger: how often its Redis changed process under it (a failover, a restart from
    #: persistence files), each followed by a pause of grants; 0 for a ledger in one process.
    failovers: int = 0

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
    """What the middleware, ``/health`` and metrics need from a ledger; every method means the
    same in the in-process :class:`~gpu_asgi.Ledger`, the Redis ledger and a user's own.

    A ledger hands out :class:`Reservation` objects built with itself; a reservation returns its
    bytes through :meth:`give_back`, exactly once per byte. Writing one: docs/ledgers.md.

    One member is optional, and so not in the protocol (a ledger written before it still is one):
    ``grow(reservation, nbytes) -> None``, which counts ``nbytes`` more for ``reservation`` (its
    ``nbytes`` already includes them) at once, even past the budget, the bytes being in use either
    way; while a device's reservations exceed its budget nothing new is admitted on it. Called by
    :meth:`Reservation.grow`, from any thread. Without it reservations cannot grow.
    """

    @property
    def devices(self) -> tuple[str, ...]:
        """The device names, in the ledger's order."""
        ...

    @property
    def max_queue(self) -> int:
        """The most requests that may wait at once; one more is refused (``QueueFull``)."""
        ...

    @property
    def max_wait(self) -> float:
        """The longest any request waits in the queue, in seconds."""
        ...

    @property
    def tenants(self) -> Mapping[str, TenantPolicy]:
        """The tenants named in advance (read-only); any other gets the default policy."""
        ...

    @property
    def availability(self) -> Availability:
        """Whether the ledger decides as configured now (``/health`` reads this)."""
        ...

    async def reserve_if_free(
        self, nbytes: int, *, devices: Sequence[str] | None = None, tenant: str = DEFAULT_TENANT
    ) -> Reservation | None:
        """The bytes now if they fit and nobody waits (within the tenant's quota), else None; never
        queues. Raises what :meth:`reserve` raises before it would queue (``NeverFits``,
        ``OverTenantQuota``, ``ValueError``)."""
        ...

    async def reserve(
        self,
        nbytes: int,
        *,
        devices: Sequence[str] | None = None,
        priority: int = 0,
        tenant: str = DEFAULT_TENANT,
        deadline: float | None = None,
    ) -> Reservation:
        """The bytes, waiting in the queue if they do not fit yet.

        ``deadline``: the seconds this request waits at most (None: the ledger's ``max_wait``; a
        longer one is cut to it). A request given one that cannot be granted at once, and whose
        predicted wait is longer, is refused at once (``DeadlineUnmeetable``).
        """
        ...

    def retry_after(self, nbytes: int = 0, *, priority: int = 0, tenant: str = DEFAULT_TENANT) -> float:
        """Seconds until such a request arriving now would likely be admitted (``Retry-After``)."""
        ...

    def tenant_policy(self, tenant: str) -> TenantPolicy: ...

    def statistics(self) -> LedgerStatistics: ...

    def give_back(self, reservation: Reservation, nbytes: int, *, finished: bool) -> None:
        """Take back ``nbytes`` of ``reservation``'s bytes (its ``nbytes`` is already what it still
        holds); ``finished`` when it was released. Called by the reservation, from any thread (not
        only the ledger's loop): a ledger whose state lives on a loop hands the call over to it."""
        ...

    async def aclose(self) -> None:
        """Let go of what the ledger keeps beyond this object (the Redis ledger: its heartbeat and
        connections, after its pending releases land); called once, at the app's shutdown, on the
        ledger's loop. A ledger with nothing of the kind does nothing."""
        ...


#: Makes a reservation's read-and-update of what it holds one step. ``shrink``/``release`` may run
#: on a worker thread while the loop releases the same reservation (the last chunk sent, the
#: endpoint returning): without it both could read the same bytes and give them back twice. One
#: lock for all: each holds it for a few attribute reads and writes, never across a call.
_HOLDING = threading.Lock()


class Reservation:
    """Bytes held on one device. Release is idempotent; the bytes return exactly once, from any
    thread."""

    __slots__ = (
        "_give_back", "_grow", "_heir", "_held", "_released", "device", "id", "requested_bytes", "tenant", "waited",
    )

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
        self._give_back = _returner(ledger)
        self._grow: Callable[[Reservation, int], None] | None = getattr(ledger, "grow", None)
        self._heir: Reservation | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held now (less than requested after :meth:`shrink`, more after :meth:`grow`)."""
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
            self._give_back(self, returned, finished=False)
        return returned

    def grow(self, nbytes: int) -> int:
        """Hold at least ``nbytes`` (an answer running past what was reserved for it); returns the
        bytes added. Granted at once, past the budget if need be (the ledger then admits nobody new
        until it is back under); 0 once released. ``NotImplementedError`` for a ledger that cannot
        grow a reservation (one without ``grow``)."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        return self._add(lambda held: max(0, nbytes - held))

    def hand_over(self, heir: Reservation | None) -> None:
        """When this reservation is released, its bytes go to ``heir`` (a reservation of the same
        ledger and device), grown by them before they leave this one, rather than back to the
        ledger: nobody waiting is granted them in between. For bytes that another reservation's
        forecast counts on once this one ends (vLLM's following lends an answer's blocks to the
        growth of the answers that outlive it). None: back to the ledger, as by default."""
        if heir is not None:
            if heir is self or heir.device != self.device:
                raise ValueError("a reservation hands its bytes over to another of the same device")
            if heir._grow is None:
                raise NotImplementedError("the heir's ledger has no grow(): it cannot take the bytes")
        self._heir = heir

    def _add(self, more: Callable[[int], int]) -> int:
        """Hold ``more(held)`` bytes more, counted by the ledger at once; 0 once released."""
        grow = self._grow
        if grow is None:
            raise NotImplementedError("this reservation's ledger has no grow(): its reservations cannot grow")
        with _HOLDING:
            added = 0 if self._released else more(self._held)
            self._held += added
        if added:
            grow(self, added)
        return added

    def release(self) -> int:
        """Return every byte still held; later calls return 0."""
        with _HOLDING:
            if self._released:
                return 0
            self._released = True
            returned, self._held = self._held, 0
        heir = self._heir
        if heir is not None and returned:
            # The heir grows first: the ledger counts the bytes twice for a moment, never zero times.
            heir._add(lambda held: returned)
        self._give_back(self, returned, finished=True)
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


def _returner(ledger: BudgetLedger) -> Callable[..., None]:
    """``ledger.give_back``; for a ledger written before it was public, its ``_give_back`` (the same
    call: the bytes returned), with a ``DeprecationWarning`` once per ledger class."""
    try:
        return ledger.give_back
    except AttributeError:
        legacy: Callable[..., None] = getattr(ledger, "_give_back")  # noqa: B009 (the old protocol's name)
        kind = type(ledger)
        if kind not in _WARNED:
            _WARNED.add(kind)
            warnings.warn(
                f"{kind.__qualname__} implements BudgetLedger._give_back; rename it give_back (same arguments): "
                "the private name stops working in the next release",
                DeprecationWarning,
                stacklevel=3,
            )
        return legacy


_WARNED: set[type] = set()
