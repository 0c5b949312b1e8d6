"""Tenants as the ledgers see them: whom a reservation is for, with an optional weight and quota.

How a request's tenant is found (a header, the OpenAI ``user`` field, ...) is the middleware's
business; the ledgers only see the key and the policy configured for it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

#: The tenant of a request that names none.
DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """A tenant's ``weight`` in the fair share, the most bytes it may hold at once (``quota_bytes``)
    and the most requests it may have waiting (``max_queue``, within the ledger's own bound);
    ``None``: no limit."""

    weight: float = 1.0
    quota_bytes: int | None = None
    max_queue: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.weight, bool) or not isinstance(self.weight, int | float):
            raise TypeError(f"weight must be a number, got {self.weight!r}")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"weight must be a positive finite number, got {self.weight!r}")
        quota = self.quota_bytes
        if quota is not None and (isinstance(quota, bool) or not isinstance(quota, int) or quota <= 0):
            raise ValueError(f"quota_bytes must be a positive integer or None, got {quota!r}")
        queue = self.max_queue
        if queue is not None and (isinstance(queue, bool) or not isinstance(queue, int) or queue < 0):
            raise ValueError(f"max_queue must be an integer >= 0 or None, got {queue!r}")


@dataclass(frozen=True, slots=True)
class TenantStatistics:
    """One tenant's part of a ledger snapshot."""

    name: str
    weight: float
    quota_bytes: int | None
    reserved_bytes: int
    in_flight: int
    waiting: int
    waiting_bytes: int
    #: Bytes x seconds held so far: the work the fair share divides by weight.
    served_byte_seconds: float


#: The policy of a tenant nobody named in advance: weight 1, no quota.
DEFAULT_POLICY = TenantPolicy()


def check_tenant_options(
    tenants: Mapping[str, TenantPolicy] | None, default_tenant_policy: TenantPolicy, tenant_idle_ttl: float
) -> None:
    """Refuse, when a ledger is built, tenant options that would fail later or differently: both
    ledgers call this, so they accept and refuse the same. Names must be ``str`` (a tenant is a
    string; the Redis ledger's JSON config would turn 7 into "7") and policies ``TenantPolicy``
    (``TypeError``); ``tenant_idle_ttl`` must be a positive, finite number of seconds
    (``ValueError``; ``TypeError`` for a non-number): "never forget" is no bound on memory, and
    the Redis ledger's expiry is a whole number of milliseconds."""
    for name, policy in dict(tenants or {}).items():
        if not isinstance(name, str):
            raise TypeError(f"tenant names must be str, got {name!r} in tenants=")
        if not isinstance(policy, TenantPolicy):
            raise TypeError(
                f"tenants[{name!r}] must be a TenantPolicy, got {type(policy).__name__} {policy!r} "
                "(for example TenantPolicy(weight=2.0))"
            )
    if not isinstance(default_tenant_policy, TenantPolicy):
        raise TypeError(
            f"default_tenant_policy must be a TenantPolicy, got {type(default_tenant_policy).__name__} "
            f"{default_tenant_policy!r}"
        )
    ttl = tenant_idle_ttl
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise TypeError(f"tenant_idle_ttl must be a number of seconds, got {ttl!r}")
    if not (math.isfinite(ttl) and ttl > 0):
        raise ValueError(f"tenant_idle_ttl must be a positive, finite number of seconds, got {ttl!r}")


def fixed_policies(tenants: Mapping[str, TenantPolicy] | None) -> Mapping[str, TenantPolicy]:
    """A ledger's ``tenants=``, copied and read-only: both ledgers' policies are fixed when the
    ledger is built. The Redis ledger hands them to its scripts once, and the in-process ledger
    keeps each tenant's policy in its account, so a change afterwards would be half applied, and
    differently by the two. To change them, build a new ledger (with Redis, restart the processes
    that share the namespace, all with the new policies)."""
    return MappingProxyType(dict(tenants or {}))
