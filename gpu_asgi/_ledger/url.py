"""Choose the ledger from configuration: in-process by default, Redis for ``redis://`` URLs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .contract import DEFAULT_MAX_BYPASS, DEFAULT_MAX_QUEUE, DEFAULT_MAX_WAIT, BudgetLedger
from .memory import Ledger

REDIS_SCHEMES = frozenset({"redis", "rediss", "unix"})


def ledger_from_url(
    url: str | None,
    capacity: int | Mapping[str, int],
    *,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_wait: float = DEFAULT_MAX_WAIT,
    max_bypass: int = DEFAULT_MAX_BYPASS,
    **redis_options: Any,
) -> BudgetLedger:
    """``None``, ``""`` or ``memory://`` → :class:`Ledger` (this process only, the default);
    ``redis://``, ``rediss://`` or ``unix://`` → ``gpu_asgi.redis_ledger.RedisLedger``, shared by
    every process on the same namespace (needs ``gpu_asgi[redis]``).

    ``redis_options`` (``namespace``, ``lease_ttl``, ``on_unavailable``, ...) go to the Redis
    ledger only; the in-process ledger has no use for them and ignores them.
    """
    common: dict[str, Any] = {"max_queue": max_queue, "max_wait": max_wait, "max_bypass": max_bypass}
    scheme = url.partition("://")[0].lower() if url else "memory"
    if scheme == "memory":
        return Ledger(capacity, **common)
    if scheme not in REDIS_SCHEMES:
        raise ValueError(f"unknown ledger URL scheme {scheme!r}: use memory://, redis://, rediss:// or unix://")
    from .redis.ledger import RedisLedger  # redis is an optional extra: imported only when asked for

    return RedisLedger(url or "", capacity, **common, **redis_options)
