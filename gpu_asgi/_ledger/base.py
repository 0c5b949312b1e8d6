"""The base class of both ledgers, :class:`LedgerBase`: what they do alike, written once. Their
shared options and the checks on them, the tenant policies, the device choice, the refusals
decided before any queue (``NeverFits``, ``OverTenantQuota``, ``DeadlineUnmeetable``) and a
request's wait bounds; and :func:`on_ledger_thread`, which hands a call to a ledger's loop.

The in-process and the Redis ledger each add their own state and count their refusals
(``_count_rejection``) where their statistics come from.
"""

from __future__ import annotations

import asyncio
import math
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._errors import NeverFits, OverTenantQuota
from .contract import (
    DEFAULT_DEVICE,
    DEFAULT_MAX_BYPASS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_WAIT,
    MAX_TIMEOUT,
    Availability,
)
from .fair_share import DEFAULT_TENANT_IDLE_TTL, check_quota
from .forecast import unmeetable
from .tenants import DEFAULT_POLICY, TenantPolicy, check_tenant_options, fixed_policies


def on_ledger_thread(loop: asyncio.AbstractEventLoop | None, thread: int, call: Callable[..., Any], *args: Any) -> None:
    """Run ``call(*args)``, a change of the ledger's state, where that state may be touched.

    ``give_back`` and ``grow`` come from any thread (a worker's shrink, the loop's release), while
    the ledger's waiters belong to its loop: a call from another thread is handed to that loop
    (``call_soon_threadsafe``) and runs later. On the loop's own thread, and when the ledger has no
    loop yet or its loop is closed (nothing else can touch the state then), it runs at once, on the
    caller's thread."""
    if loop is not None and threading.get_ident() != thread and not loop.is_closed():
        loop.call_soon_threadsafe(call, *args)
    else:
        call(*args)


class LedgerBase:
    """A ledger's configuration and the checks every request gets, the same in both backends.

    ``capacity``: bytes for one device (``"cuda:0"``) or a mapping of device name to bytes, each
    positive. ``max_queue``, ``max_wait``, ``max_bypass`` and the tenant options mean the same
    in every ledger; both refuse the same values at construction.
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
    ) -> None:
        capacities = {DEFAULT_DEVICE: capacity} if isinstance(capacity, int) else dict(capacity)
        if not capacities:
            raise ValueError("a ledger needs at least one device")
        for name, nbytes in capacities.items():
            if nbytes <= 0:
                raise ValueError(f"device {name!r} needs a positive byte capacity, got {nbytes}")
        if max_bypass < 0 or max_queue < 0:
            raise ValueError("max_bypass and max_queue must be >= 0")
        check_tenant_options(tenants, default_tenant_policy, tenant_idle_ttl)
        self._capacities = capacities
        self._largest = max(capacities.values())
        self.max_queue = max_queue
        self.max_wait = max_wait
        self.max_bypass = max_bypass
        #: Weights and quotas of the tenants named in advance; any other tenant gets the default.
        #: Read-only, fixed when the ledger is built (``fixed_policies``).
        self.tenants = fixed_policies(tenants)
        self._default_tenant_policy = default_tenant_policy
        self._tenant_idle_ttl = tenant_idle_ttl

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(self._capacities)

    def capacity(self, device: str = DEFAULT_DEVICE) -> int:
        return self._capacities[device]

    @property
    def availability(self) -> Availability:
        return "available"

    @property
    def default_tenant_policy(self) -> TenantPolicy:
        """The policy of every tenant not in ``tenants``; fixed, as those are."""
        return self._default_tenant_policy

    @property
    def tenant_idle_ttl(self) -> float:
        """Seconds a tenant with nothing held or waiting is remembered."""
        return self._tenant_idle_ttl

    def tenant_policy(self, tenant: str) -> TenantPolicy:
        return self.tenants.get(tenant, self._default_tenant_policy)

    def _count_rejection(self, reason: str) -> None:
        raise NotImplementedError

    def _choose(self, devices: Sequence[str] | None, nbytes: int) -> tuple[str, ...]:
        """The devices a request may use, in the ledger's order; ``NeverFits`` (counted) when
        none could ever hold ``nbytes``, ``ValueError`` for a bad size or device."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        if devices is None:
            names = self.devices
        else:
            chosen = set(devices)
            unknown = [name for name in devices if name not in self._capacities]
            if unknown:
                raise ValueError(f"unknown device {unknown[0]!r}; the ledger has {self.devices}")
            if not chosen:
                raise ValueError(f"no device given; the ledger has {self.devices}")
            names = tuple(name for name in self._capacities if name in chosen)  # the ledger's order, always
        largest = max(self._capacities[name] for name in names)
        if nbytes > largest:
            self._count_rejection(NeverFits.reason)
            raise NeverFits(
                f"The request needs {nbytes} bytes of GPU memory; the largest budget is {largest} bytes.",
                required_bytes=nbytes,
                budget_bytes=largest,
            )
        return names

    def _check_quota(self, tenant: str, nbytes: int) -> None:
        """``OverTenantQuota`` (counted) for a request larger than its tenant's whole quota."""
        try:
            check_quota(self.tenant_policy(tenant), nbytes)
        except OverTenantQuota:
            self._count_rejection(OverTenantQuota.reason)
            raise

    def _wait_bounds(
        self, deadline: float | None, timeout: float | None = None, wait_limit: float | None = None
    ) -> tuple[float, float]:
        """``(limit, wait)``: the seconds the deadline rule decides on (``inf``: it refuses nothing),
        and the seconds the request waits in the queue at most.

        ``deadline`` gives both (the wait cut to ``max_wait``); None is ``max_wait``, so a request
        predicted to wait longer than the queue would keep it is refused at arrival, not at the end
        of its wait (docs/admission.md, "Deadlines"). ``inf`` is the patient queue: it waits
        ``max_wait`` and is never refused early. ``timeout`` and ``wait_limit`` are the two arguments
        ``deadline`` replaces, accepted for one release with a ``DeprecationWarning``, with their old
        meaning: ``timeout`` the wait (default ``max_wait``), ``wait_limit`` the limit.
        """
        if timeout is None and wait_limit is None:
            if deadline is None:
                return self.max_wait, self.max_wait
            if not deadline >= 0:  # NaN too
                raise ValueError(f"deadline must be a number of seconds >= 0, got {deadline!r}")
            return deadline, min(deadline, self.max_wait)
        if deadline is not None:
            raise TypeError("reserve() takes deadline= alone: timeout= and wait_limit= are its deprecated forms")
        warnings.warn(
            "reserve(timeout=, wait_limit=) are deprecated: pass deadline= (the seconds the request waits "
            "at most, cut to the ledger's max_wait; a request predicted to wait longer is refused at once)",
            DeprecationWarning,
            stacklevel=3,
        )
        return math.inf if wait_limit is None else wait_limit, self.max_wait if timeout is None else timeout

    def _refuse_unmeetable(self, limit: float, release_rate: float, predict: Callable[[], float]) -> float | None:
        """The wait predicted for a request that must queue, where it promises admission within
        ``limit``; raises (and counts) ``DeadlineUnmeetable`` when the prediction is longer
        (``forecast.unmeetable``). None where nothing was promised: no drain rate observed yet, the
        patient queue, or a prediction at the 1 s floor over a shorter limit (queued, not refused).
        A queued request that times out carries the prediction it queued on: it was wrong."""
        if not release_rate > 0 or limit >= MAX_TIMEOUT:
            return None
        predicted = predict()
        refusal = unmeetable(limit, predicted)
        if refusal is not None:
            self._count_rejection(refusal.reason)
            raise refusal
        return predicted if predicted <= limit else None
