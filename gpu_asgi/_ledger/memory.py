"""The in-process byte ledger: one VRAM budget per device, a bounded fair queue, reservations granted from it.

The decision rule (docs/admission.md, "The ledger") in short: waiters queue in lanes, one per
(tenant, priority, size class, allowed devices), each strictly FIFO; only lane heads are looked
at, by their tenant's virtual time (``fair_share``), then priority, then arrival. A head that
fits (within its tenant's quota) is admitted; one admitted while a head ahead of it (lower virtual
time, or the same and an earlier arrival) could use the same device counts as passing that head,
and a head passed ``max_bypass`` times keeps its devices from every head behind it until it fits.
With one tenant this is plain priority-then-arrival order. The Redis ledger runs the same rule in
Lua. While the ledger's event loop runs, its state is touched only from that loop, so
check-and-reserve is atomic without locks: ``give_back`` and ``grow``, which a reservation calls
from any thread, hand a call from another thread to that loop (``base.on_ledger_thread``). The contract it
implements (``BudgetLedger``, ``Reservation``, the statistics) is in ``contract``; the options,
checks and refusals it shares with the Redis ledger in ``base`` (``LedgerBase``).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from .._errors import QueueFull, QueueTimeout
from .base import LedgerBase, on_ledger_thread
from .contract import (
    DEFAULT_MAX_BYPASS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_WAIT,
    MAX_TIMEOUT,
    DeviceStatistics,
    LedgerStatistics,
    Reservation,
    check_priority,
)
from .drain import DrainRate
from .fair_share import DEFAULT_TENANT_IDLE_TTL, FairShare
from .forecast import predicted_wait, queue_timeout, size_class
from .tenants import DEFAULT_POLICY, DEFAULT_TENANT, TenantPolicy


class _Device:
    __slots__ = ("capacity", "in_flight", "index", "name", "reserved")

    def __init__(self, index: int, name: str, capacity: int) -> None:
        self.index = index
        self.name = name
        self.capacity = capacity
        self.reserved = 0
        self.in_flight = 0

    @property
    def free(self) -> int:
        return self.capacity - self.reserved


#: (priority, size class, device indexes, tenant)
_Lane = tuple[int, int, tuple[int, ...], str]


class _Waiter:
    __slots__ = ("devices", "future", "lane", "nbytes", "passed", "priority", "seq", "since", "tenant")

    def __init__(
        self, seq: int, nbytes: int, devices: tuple[_Device, ...], priority: int, since: float, tenant: str
    ) -> None:
        self.seq = seq
        self.tenant = tenant
        self.nbytes = nbytes
        self.devices = devices
        self.priority = priority
        self.lane: _Lane = (priority, size_class(nbytes), tuple(d.index for d in devices), tenant)
        self.future: asyncio.Future[Reservation] = asyncio.get_running_loop().create_future()
        #: Admissions of heads behind it, onto a device this waiter could use, while it headed its lane.
        self.passed = 0
        self.since = since


class Ledger(LedgerBase):
    """Byte budgets for one or more devices, shared by every request of this process.

    ``capacity`` is the budget in bytes for a single device (named ``"cuda:0"``) or a mapping
    of device name to budget. Derive budgets with :func:`budget_bytes`: weights and runtime
    overhead come off once there, never per request. A ledger serves one event loop at a time;
    a reservation may be shrunk or released from any thread. ``tenants`` name weights and quotas
    (any other tenant gets ``default_tenant_policy``), fixed for the ledger's life; a tenant with
    nothing held or waiting is forgotten after ``tenant_idle_ttl`` seconds.
    """

    def __init__(
        self,
        capacity: int | Mapping[str, int],
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_wait: float = DEFAULT_MAX_WAIT,
        max_bypass: int = DEFAULT_MAX_BYPASS,
        tenants: Mapping[str, TenantPolicy] | None = None,
        default_tenant_policy: TenantPolicy = DEFAULT_POLICY,
        tenant_idle_ttl: float = DEFAULT_TENANT_IDLE_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            capacity,
            max_queue=max_queue,
            max_wait=max_wait,
            max_bypass=max_bypass,
            tenants=tenants,
            default_tenant_policy=default_tenant_policy,
            tenant_idle_ttl=tenant_idle_ttl,
        )
        self._devices = {name: _Device(i, name, nbytes) for i, (name, nbytes) in enumerate(self._capacities.items())}
        self._all = tuple(self._devices.values())
        self._fair = FairShare(self.tenants, default_tenant_policy, tenant_idle_ttl)
        self._clock = clock
        #: lane key -> seq -> waiter, FIFO. Only lane heads are ever examined.
        self._lanes: dict[_Lane, OrderedDict[int, _Waiter]] = {}
        self._waiting = 0
        self._waiting_bytes = 0
        self._lane_bytes: dict[_Lane, int] = {}
        self._reserved = 0
        self._ids = itertools.count(1)
        self._admitted = 0
        self._rejected: dict[str, int] = {}
        self._drain = DrainRate(clock())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0

    def __repr__(self) -> str:
        budgets = ", ".join(f"{d.name}={d.capacity}" for d in self._all)
        return f"Ledger({budgets}, max_queue={self.max_queue}, max_wait={self.max_wait}, max_bypass={self.max_bypass})"

    # -- admission ----------------------------------------------------------------------

    async def reserve_if_free(
        self, nbytes: int, *, devices: Sequence[str] | None = None, tenant: str = DEFAULT_TENANT
    ) -> Reservation | None:
        """:meth:`try_reserve`, as the protocol's coroutine (the Redis ledger's needs a round trip)."""
        return self.try_reserve(nbytes, devices=devices, tenant=tenant)

    def try_reserve(
        self, nbytes: int, *, devices: Sequence[str] | None = None, tenant: str = DEFAULT_TENANT
    ) -> Reservation | None:
        """Reserve at once if nobody is queued and the bytes fit, within the tenant's quota; never waits or queues.

        This ledger's own synchronous form of :meth:`reserve_if_free` (no other ledger can answer
        without awaiting).
        """
        allowed = self._allowed(devices, nbytes)
        fits = self._fits_quota(tenant, nbytes)
        if self._waiting or not fits:
            return None
        self._bind()
        device = _place(nbytes, allowed)
        return None if device is None else self._grant(device, nbytes, 0.0, tenant, self._clock())

    async def reserve(
        self,
        nbytes: int,
        *,
        devices: Sequence[str] | None = None,
        priority: int = 0,
        tenant: str = DEFAULT_TENANT,
        deadline: float | None = None,
        timeout: float | None = None,
        wait_limit: float | None = None,
    ) -> Reservation:
        """Reserve ``nbytes`` for ``tenant`` on one of ``devices``, waiting in the queue if they do not fit yet.

        Raises :class:`NeverFits` at once when no allowed device could ever hold the bytes,
        :class:`OverTenantQuota` when the tenant's quota could never hold them, :class:`QueueFull`
        when the queue is at ``max_queue``, and :class:`QueueTimeout` after ``deadline`` seconds
        (cut to ``max_wait``; None: ``max_wait``); ``ValueError`` for a priority outside
        ``MIN_PRIORITY..MAX_PRIORITY``. Cancelling the caller leaves the queue cleanly, and bytes
        granted in the same instant are passed on, never leaked.

        With a ``deadline``, a request that cannot be granted at once and whose predicted wait
        (:meth:`retry_after`, now, before it joins) is longer gets :class:`DeadlineUnmeetable` at
        once, before any queue check (docs/admission.md, "Deadlines"). ``timeout`` and
        ``wait_limit`` are deprecated (``LedgerBase._wait_bounds``).
        """
        limit, wait = self._wait_bounds(deadline, timeout, wait_limit)
        return await self._reserve(nbytes, devices, priority, tenant, limit, wait)

    async def _reserve(
        self, nbytes: int, devices: Sequence[str] | None, priority: int, tenant: str, limit: float, wait: float
    ) -> Reservation:
        """:meth:`reserve` with its bounds resolved: the deadline rule decides on ``limit`` (``inf``:
        it refuses nothing), and the request waits ``wait`` seconds at most. The Redis ledger's local fallback
        calls this with what is left of a request's wait."""
        check_priority(priority)
        allowed = self._allowed(devices, nbytes)
        fits = self._fits_quota(tenant, nbytes)
        self._bind()
        now = self._clock()
        if not self._waiting and fits:
            device = _place(nbytes, allowed)
            if device is not None:
                return self._grant(device, nbytes, 0.0, tenant, now)
        predicted = self._refuse_unmeetable(
            limit, self.release_rate(), lambda: self.retry_after(nbytes, priority=priority, tenant=tenant)
        )
        if self._waiting >= self.max_queue:
            self._count_rejection(QueueFull.reason)
            raise QueueFull(
                f"{self._waiting} requests are already waiting for GPU memory.",
                retry_after=self.retry_after(nbytes, priority=priority, tenant=tenant),
            )
        own = self._fair.waiting(tenant)
        tenant_queue = self._fair.policy(tenant).max_queue
        if tenant_queue is not None and own >= tenant_queue:
            self._count_rejection(QueueFull.reason)
            raise QueueFull(
                f"{own} requests of this tenant are already waiting for GPU memory (its limit).",
                retry_after=self.retry_after(nbytes, priority=priority, tenant=tenant),
            )
        waiter = _Waiter(next(self._ids), nbytes, allowed, priority, now, tenant)
        self._fair.queued(tenant, nbytes, now)
        self._lanes.setdefault(waiter.lane, OrderedDict())[waiter.seq] = waiter
        self._waiting += 1
        self._waiting_bytes += nbytes
        self._lane_bytes[waiter.lane] = self._lane_bytes.get(waiter.lane, 0) + nbytes
        self._dispatch()
        if waiter.future.done():
            return waiter.future.result()
        try:
            async with asyncio.timeout(wait if wait < MAX_TIMEOUT else None):
                return await waiter.future
        except BaseException as exc:
            if waiter.future.done() and not waiter.future.cancelled():
                waiter.future.result().release()  # granted as we were cancelled: pass the bytes on
            else:
                self._dequeue(waiter)
                self._dispatch()  # the one that left may have held back others
            if isinstance(exc, TimeoutError):
                self._count_rejection(QueueTimeout.reason)
                raise queue_timeout(
                    nbytes, wait, self.retry_after(nbytes, priority=priority, tenant=tenant), predicted
                ) from None
            raise

    def _bind(self) -> None:
        """Serve the running event loop; a second loop while the first still runs is an error."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # synchronous use (tests, scripts): nothing can wait
        if loop is self._loop:
            return
        if self._loop is not None and self._loop.is_running() and not self._loop.is_closed():
            raise RuntimeError(
                "this Ledger already serves another running event loop; a ledger's waiters live on one "
                "loop: create one ledger per event loop (one per process for a shared budget: RedisLedger)"
            )
        self._loop, self._thread = loop, threading.get_ident()

    def _allowed(self, devices: Sequence[str] | None, nbytes: int) -> tuple[_Device, ...]:
        if devices is None and 0 <= nbytes <= self._largest:  # the common case: every device
            return self._all
        return tuple(self._devices[name] for name in self._choose(devices, nbytes))

    def _fits_quota(self, tenant: str, nbytes: int) -> bool:
        """Whether ``tenant`` may hold ``nbytes`` more now; :class:`OverTenantQuota` (counted) if never."""
        self._check_quota(tenant, nbytes)
        return self._fair.fits(tenant, nbytes)

    def _grant(self, device: _Device, nbytes: int, waited: float, tenant: str, now: float) -> Reservation:
        # Busy while bytes are reserved (as _returned and the Lua scripts' finish()): a zero-byte
        # grant with nothing else reserved leaves the drain rate's clock idle.
        self._drain.advance(now, busy=self._reserved + nbytes > 0)
        self._fair.hold(tenant, nbytes, 1, now)
        device.reserved += nbytes
        device.in_flight += 1
        self._reserved += nbytes
        self._admitted += 1
        return Reservation(self, f"r{next(self._ids)}", device.name, nbytes, waited, tenant)

    def _dispatch(self) -> None:
        """Admit lane heads while one can be admitted (see the module docstring)."""
        if not self._waiting:  # the common case, at every release: no clock read, no locals
            return
        now = self._clock()
        accounts = self._fair.accounts
        while self._waiting:
            heads = self._heads()
            vt = {h.tenant: accounts[h.tenant].vt_at(now) for h in heads}
            # Quota-blocked heads are neither admitted nor passed, and claim nothing.
            heads = [h for h in heads if accounts[h.tenant].fits(h.nbytes)]
            heads.sort(key=lambda h: (vt[h.tenant], -h.priority, h.seq))
            claims = [h for h in heads if h.passed >= self.max_bypass]  # usually none
            for waiter in heads:
                device = _placement(waiter, claims, vt)
                if device is not None:
                    break
            else:
                return
            mine = (vt[waiter.tenant], waiter.seq)
            for other in heads:  # the admitted one passes the heads ahead of it that could use its device
                if (vt[other.tenant], other.seq) < mine and device in other.devices:
                    other.passed += 1
            self._dequeue(waiter, admitted=True)
            waiter.future.set_result(self._grant(device, waiter.nbytes, now - waiter.since, waiter.tenant, now))

    def _heads(self) -> list[_Waiter]:
        """Each lane's first live waiter; cancelled ones are dropped."""
        heads = []
        for lane in list(self._lanes.values()):
            while lane:
                waiter = next(iter(lane.values()))
                if not waiter.future.done():
                    heads.append(waiter)
                    break
                self._dequeue(waiter)  # cancelled, its task has not run its cleanup yet
        return heads

    def _dequeue(self, waiter: _Waiter, *, admitted: bool = False) -> None:
        lane = self._lanes.get(waiter.lane)
        if lane is None or lane.pop(waiter.seq, None) is None:
            return
        if not lane:
            del self._lanes[waiter.lane]
            del self._lane_bytes[waiter.lane]
        else:
            self._lane_bytes[waiter.lane] -= waiter.nbytes
        self._waiting -= 1
        self._waiting_bytes -= waiter.nbytes
        self._fair.left(waiter.tenant, waiter.nbytes, self._clock(), admitted=admitted)

    def give_back(self, reservation: Reservation, nbytes: int, *, finished: bool) -> None:
        """Take back ``nbytes`` of ``reservation`` (the bytes it just returned); see ``BudgetLedger``."""
        on_ledger_thread(self._loop, self._thread, self._returned, reservation.device, reservation.tenant, nbytes, finished)

    def grow(self, reservation: Reservation, nbytes: int) -> None:
        """Count ``nbytes`` more for ``reservation``, past the budget if need be; see ``BudgetLedger``."""
        on_ledger_thread(self._loop, self._thread, self._grown, reservation.device, reservation.tenant, nbytes)

    async def aclose(self) -> None:
        """Nothing to let go of: this ledger keeps no connection and runs no task of its own."""

    def _grown(self, name: str, tenant: str, nbytes: int) -> None:
        # No dispatch: growing frees nothing. A device past its budget has negative free bytes, so
        # _place admits nobody on it until releases bring it back under.
        device = self._devices[name]
        now = self._clock()
        self._drain.advance(now, busy=True)
        self._fair.hold(tenant, nbytes, 0, now)
        device.reserved += nbytes
        self._reserved += nbytes

    def _returned(self, name: str, tenant: str, nbytes: int, finished: bool) -> None:
        device = self._devices[name]
        now = self._clock()
        self._drain.advance(now, busy=self._reserved > nbytes)
        self._fair.hold(tenant, -nbytes, -1 if finished else 0, now)
        device.reserved -= nbytes
        self._reserved -= nbytes
        if finished:
            device.in_flight -= 1
        self._drain.released(nbytes)
        self._dispatch()

    # -- rates and statistics -------------------------------------------------------------

    def _count_rejection(self, reason: str) -> None:
        self._rejected[reason] = self._rejected.get(reason, 0) + 1

    def release_rate(self) -> float:
        """Bytes given back per busy second (an average over about ``RATE_WINDOW`` busy seconds), as of now."""
        return self._drain.rate_at(self._clock())

    def retry_after(self, nbytes: int = 0, *, priority: int = 0, tenant: str = DEFAULT_TENANT) -> float:
        """Seconds until a request of ``tenant`` for ``nbytes`` at ``priority`` arriving now would likely be admitted.

        ``(bytes queued ahead + nbytes - free bytes) / drain rate``, within [1 s, 600 s]. Ahead
        are the waiters ordered before it (its tenant's at its priority or higher, and those of
        tenants whose virtual time is below its own: ``lanes_ahead``) that are likely to be
        admitted first (``bytes_ahead``: its size class or smaller, and the larger heads the
        bounded bypass lets claim). While other tenants hold or wait, its own tenant's bytes
        ahead at its tenant's admission rate instead (``predicted_wait``). A tenant with a quota
        waits at least until enough of its own bytes have come back to make room for it
        (``quota_wait``). With no release observed yet, ``max_wait``, within the same range.
        """
        lanes = [(key[0], key[1], key[3], len(self._lanes[key]), n) for key, n in self._lane_bytes.items()]
        standings = self._fair.standings(self._clock(), tenant)
        free = sum(device.free for device in self._all)
        quota = self._fair.policy(tenant).quota_bytes
        return predicted_wait(
            lanes, tenant, nbytes, priority, standings, free, self.release_rate(), self.max_bypass, self.max_wait, quota
        )

    def statistics(self) -> LedgerStatistics:
        return LedgerStatistics(
            devices=tuple(DeviceStatistics(d.name, d.capacity, d.reserved, d.in_flight) for d in self._all),
            waiting=self._waiting,
            waiting_bytes=self._waiting_bytes,
            admitted_total=self._admitted,
            rejected_total=dict(self._rejected),
            release_rate_bytes_per_second=self.release_rate(),
            tenants=self._fair.statistics(self._clock()),
        )


def _placement(waiter: _Waiter, claims: list[_Waiter], vt: Mapping[str, float]) -> _Device | None:
    """The device ``waiter`` is admitted on now, if any: the allowed one with the most free bytes
    among those no head ahead of it (lower virtual time, or the same and earlier) has claimed by
    being passed ``max_bypass`` times."""
    mine = (vt[waiter.tenant], waiter.seq)
    claimed = [h.devices for h in claims if (vt[h.tenant], h.seq) < mine]
    if not claimed:
        return _place(waiter.nbytes, waiter.devices)
    usable = tuple(d for d in waiter.devices if not any(d in devices for devices in claimed))
    return _place(waiter.nbytes, usable) if usable else None


def _place(nbytes: int, devices: tuple[_Device, ...]) -> _Device | None:
    """The device with the most free bytes (the first such, in the ledger's order), if the request fits there."""
    best = max(devices, key=lambda d: d.free) if len(devices) > 1 else devices[0]
    return best if best.free >= nbytes else None
