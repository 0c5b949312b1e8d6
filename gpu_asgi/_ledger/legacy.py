"""A ledger written to the protocol before this release, adapted to today's :class:`BudgetLedger`.

Up to 0.x a user's ledger implemented ``try_reserve`` (synchronous), ``reserve(..., timeout=,
wait_limit=)``, ``retry_after``, ``tenant_policy``, ``statistics`` and ``_give_back``, and the
middleware read ``max_wait``, ``max_queue``, ``tenants`` and ``available`` where a ledger had
them; ``aclose`` joined the protocol later still. :func:`as_budget_ledger` looks at a ledger once,
when the middleware (or ``/health``, or the metrics) is built: one in today's shape is used as it
is; one in an older shape is wrapped in :class:`LegacyLedger`, with a ``DeprecationWarning``, for
one release. Only this module probes a ledger for what it has.
"""

from __future__ import annotations

import inspect
import math
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from .contract import Availability, BudgetLedger, LedgerStatistics, Reservation
from .tenants import DEFAULT_TENANT, TenantPolicy

#: What today's protocol has that an old-shape ledger may lack (``reserve``'s ``deadline`` aside).
_MEMBERS = ("max_queue", "max_wait", "tenants", "availability", "reserve_if_free", "give_back", "aclose")


def as_budget_ledger(ledger: Any) -> BudgetLedger:
    """``ledger`` itself when it implements today's protocol, else a :class:`LegacyLedger` around it."""
    missing = [name for name in _MEMBERS if not hasattr(ledger, name)]
    if not missing and _takes_deadline(ledger):
        return ledger  # type: ignore[no-any-return]
    if not missing:
        missing = ["reserve(deadline=)"]
    warnings.warn(
        f"{type(ledger).__qualname__} implements the BudgetLedger protocol of an earlier release (it lacks "
        f"{', '.join(missing)}); it is adapted for now, and will stop working in the next release: "
        "see docs/ledgers.md, 'Writing your own ledger'",
        DeprecationWarning,
        stacklevel=3,
    )
    return LegacyLedger(ledger)


def _takes_deadline(ledger: Any) -> bool:
    """Whether ``ledger.reserve`` accepts ``deadline=`` (by name, or through ``**options``)."""
    parameters = inspect.signature(ledger.reserve).parameters.values()
    return any(p.name == "deadline" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


class LegacyLedger:
    """Today's :class:`BudgetLedger` over a ledger in the old shape (see the module docstring).

    What the old ledger lacks takes the value the middleware assumed then: no ``max_queue`` or
    ``max_wait`` bound, no named tenants, always available, nothing to close.
    """

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger
        self.max_queue: int = getattr(ledger, "max_queue", sys.maxsize)
        self.max_wait: float = getattr(ledger, "max_wait", math.inf)
        self.tenants: Mapping[str, TenantPolicy] = getattr(ledger, "tenants", {})
        reserve = getattr(ledger, "reserve", None)  # None in a fake that only reports (metrics' tests)
        self._deadline = reserve is not None and _takes_deadline(ledger)
        self._old_wait = (
            reserve is not None and {"timeout", "wait_limit"} <= inspect.signature(reserve).parameters.keys()
        )
        self._has_availability = hasattr(ledger, "availability")
        self._has_available = hasattr(ledger, "available")
        self._local_fallback = getattr(ledger, "on_unavailable", "fail-closed") == "local"
        self._if_free = getattr(ledger, "reserve_if_free", None)
        self._give_back = getattr(ledger, "give_back", None) or getattr(ledger, "_give_back", None)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(self.ledger.devices)

    @property
    def availability(self) -> Availability:
        if self._has_availability:
            return self.ledger.availability  # type: ignore[no-any-return]
        if not self._has_available or self.ledger.available:
            return "available"
        return "local" if self._local_fallback else "unavailable"

    async def reserve_if_free(
        self, nbytes: int, *, devices: Sequence[str] | None = None, tenant: str = DEFAULT_TENANT
    ) -> Reservation | None:
        if self._if_free is not None:
            return await self._if_free(nbytes, devices=devices, tenant=tenant)  # type: ignore[no-any-return]
        return self.ledger.try_reserve(nbytes, devices=devices, tenant=tenant)  # type: ignore[no-any-return]

    async def reserve(
        self,
        nbytes: int,
        *,
        devices: Sequence[str] | None = None,
        priority: int = 0,
        tenant: str = DEFAULT_TENANT,
        deadline: float | None = None,
    ) -> Reservation:
        options: dict[str, Any] = {"devices": devices, "priority": priority, "tenant": tenant}
        if self._deadline:
            options["deadline"] = deadline
        elif deadline is not None:
            if not self._old_wait:
                raise TypeError(f"{type(self.ledger).__qualname__}.reserve takes neither deadline= nor wait_limit=")
            # The old pair, as the middleware passed it: the wait cut to max_wait, and the limit.
            options |= {"timeout": min(deadline, self.max_wait), "wait_limit": deadline}
        return await self.ledger.reserve(nbytes, **options)  # type: ignore[no-any-return]

    def retry_after(self, nbytes: int = 0, *, priority: int = 0, tenant: str = DEFAULT_TENANT) -> float:
        return self.ledger.retry_after(nbytes, priority=priority, tenant=tenant)  # type: ignore[no-any-return]

    def tenant_policy(self, tenant: str) -> TenantPolicy:
        return self.ledger.tenant_policy(tenant)  # type: ignore[no-any-return]

    def statistics(self) -> LedgerStatistics:
        return self.ledger.statistics()  # type: ignore[no-any-return]

    def give_back(self, reservation: Reservation, nbytes: int, *, finished: bool) -> None:
        # The old ledger's reservations call it themselves; this is for a caller that asks the adapter.
        if self._give_back is None:
            raise TypeError(f"{type(self.ledger).__qualname__} has no give_back")
        self._give_back(reservation, nbytes, finished=finished)

    async def aclose(self) -> None:
        aclose = getattr(self.ledger, "aclose", None)
        if aclose is not None:  # else nothing to close, as the middleware assumed then
            await aclose()

    def grow(self, reservation: Reservation, nbytes: int) -> None:
        grow = getattr(self.ledger, "grow", None)
        if grow is None:
            raise NotImplementedError(f"{type(self.ledger).__qualname__} cannot grow a reservation (it has no grow)")
        grow(reservation, nbytes)

    def __repr__(self) -> str:
        return f"LegacyLedger({self.ledger!r})"
