"""Choose the ledger from configuration: in-process by default, Redis for ``redis://`` URLs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .contract import DEFAULT_MAX_BYPASS, DEFAULT_MAX_QUEUE, DEFAULT_MAX_WAIT, BudgetLedger
from .fair_share import DEFAULT_TENANT_IDLE_TTL
from .memory import Ledger
from .tenants import DEFAULT_POLICY, TenantPolicy

REDIS_SCHEMES = frozenset({"redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel"})
#: ``RedisLedger``'s own options: how to reach Redis and what to do while it is away. They configure
#: no part of the in-process ledger (there is no connection), so a ``memory://`` URL accepts and
#: leaves them, and one call serves both configurations (docs/deployment.md).
REDIS_CONNECTION_OPTIONS = frozenset(
    {"namespace", "lease_ttl", "heartbeat", "poll_interval", "notify", "redis_timeout", "max_connections",
     "on_unavailable", "local_share", "replicas"}
)  # fmt: skip


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
    ``redis://``, ``rediss://``, ``unix://`` or Sentinel's ``redis+sentinel://host:26379,...
    /service[/db]`` (``rediss+sentinel://`` for TLS) → :class:`~gpu_asgi.RedisLedger`, shared by
    every process on the same namespace (needs ``gpu_asgi[redis]``).

    Every option that decides admission (the queue's bounds, the tenants' weights, quotas and
    idle time) goes to either ledger by name, so one configuration admits alike on both.
    ``redis_options`` are the Redis ledger's connection options (``REDIS_CONNECTION_OPTIONS``:
    ``namespace``, ``lease_ttl``, ``on_unavailable``, ...); an in-process URL has no connection
    for them to configure and leaves them. Any other name is a ``TypeError`` naming it, at once,
    whatever the URL.
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
    unknown = sorted(set(redis_options) - REDIS_CONNECTION_OPTIONS)
    if unknown:
        raise TypeError(f"ledger_from_url() got an unexpected keyword argument {unknown[0]!r}")
    if scheme == "memory":
        return Ledger(capacity, **shared)
    if scheme not in REDIS_SCHEMES:
        raise ValueError(
            f"unknown ledger URL scheme {scheme!r}: use memory://, redis://, rediss://, unix:// or redis+sentinel://"
        )
    from .redis.ledger import RedisLedger  # redis is an optional extra: imported only when asked for

    return RedisLedger(url or "", capacity, **shared, **redis_options)
