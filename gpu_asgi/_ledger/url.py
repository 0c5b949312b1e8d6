"""Choose the ledger from configuration: in-process by default, Redis for ``redis://`` URLs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .contract import DEFAULT_MAX_BYPASS, DEFAULT_MAX_QUEUE, DEFAULT_MAX_WAIT, BudgetLedger
from .fair_share import DEFAULT_TENANT_IDLE_TTL
from .memory import Ledger
from .tenants import DEFAULT_POLICY, TenantPolicy

REDIS_SCHEMES = frozenset({"redis", "rediss", "unix"})


def ledger_from_url(
    url: str | None,
    capacity: int | Mapping[str, int],
    *,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_wait: float = DEFAULT_MAX_WAIT,
    max_bypass: int = DEFAULT_MAX_BYPASS,
    tenants: Mapping[str, TenantPolicy] | None = None,
    default_tenant_policy: TenantPolicy = DEFAULT_POLICY,
    tenant_idle_ttl: float = DEFAULT_TENANT_IDLE_TTL,
    **redis_options: Any,
) -> BudgetLedger:
    """``None``, ``""`` or ``memory://`` → :class:`Ledger` (this process only, the default);
    ``redis://``, ``rediss://`` or ``unix://`` → :class:`~gpu_asgi.RedisLedger`, shared by every
    process on the same namespace (needs ``gpu_asgi[redis]``).

    The options both ledgers take (the queue's bounds and the tenants') go to either, so one
    configuration behaves the same on both. ``redis_options`` (``namespace``, ``lease_ttl``,
    ``on_unavailable``, ...) only the Redis ledger can honour: given with an in-process URL they
    are a ``TypeError`` naming them, never silently dropped.
    """
    shared: dict[str, Any] = {
        "max_queue": max_queue,
        "max_wait": max_wait,
        "max_bypass": max_bypass,
        "tenants": tenants,
        "default_tenant_policy": default_tenant_policy,
        "tenant_idle_ttl": tenant_idle_ttl,
    }
    scheme = url.partition("://")[0].lower() if url else "memory"
    if scheme == "memory":
        if redis_options:
            names = ", ".join(sorted(redis_options))
            raise TypeError(f"ledger_from_url({url!r}): the in-process ledger has no option {names} (Redis only)")
        return Ledger(capacity, **shared)
    if scheme not in REDIS_SCHEMES:
        raise ValueError(f"unknown ledger URL scheme {scheme!r}: use memory://, redis://, rediss:// or unix://")
    from .redis.ledger import RedisLedger  # redis is an optional extra: imported only when asked for

    return RedisLedger(url or "", capacity, **shared, **redis_options)
