"""``Retry-After``'s model, the same for both ledgers: which queued bytes go before a request
arriving now, and how long until it would be admitted (docs/admission.md, "Retry-After")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ._drain import retry_after
from ._fair_share import Standing, lanes_ahead


def bytes_ahead(lanes: Iterable[tuple[int, int, int, int]], nbytes: int, priority: int, max_bypass: int) -> float:
    """Queued bytes likely admitted before a request of ``nbytes`` at ``priority`` arriving now.

    ``lanes`` are (priority, size class, waiters, bytes). Lanes at a lower priority wait behind
    it. Those of its size class or a smaller one are ahead of it. A larger lane's head may be
    passed, but only ``max_bypass`` times before it claims its device: for every
    ``max_bypass + 1`` admissions ahead of the request, one waiter of each larger lane goes first
    (counted until that adds no more, at the lane's mean size).
    """
    mine = size_class(nbytes)
    ahead_bytes = ahead_count = 0
    larger: list[tuple[int, float]] = []  # (waiters, mean bytes)
    for p, c, waiters, nb in lanes:
        if p < priority or waiters <= 0:
            continue
        if c <= mine:
            ahead_bytes += nb
            ahead_count += waiters
        else:
            larger.append((waiters, nb / waiters))
    admissions = ahead_count
    while True:  # each larger waiter that goes first is one more admission, passing the others
        first = [min(waiters, admissions // (max_bypass + 1)) for waiters, _ in larger]
        total = ahead_count + sum(first)
        if total == admissions:
            break
        admissions = total
    return ahead_bytes + sum(n * mean for n, (_, mean) in zip(first, larger, strict=True))


def predicted_wait(
    lanes: Sequence[tuple[int, int, str, int, int]],
    tenant: str,
    nbytes: int,
    priority: int,
    standings: Mapping[str, Standing],
    free: int,
    release_rate: float,
    max_bypass: int,
    max_wait: float,
) -> float:
    """``Retry-After`` for a request of ``tenant`` arriving now, the same in both ledgers.

    ``lanes`` are (priority, size class, tenant, waiters, bytes). While another tenant holds or
    waits and ``tenant`` has an admission rate (``Standing.rate``), its queue moves at that rate:
    ``(its own bytes ahead + nbytes - free) / its rate``. That rate already nets out what tenants
    ordered before it take, later arrivals with a lower virtual time included, which counting the
    bytes ahead now cannot. Otherwise (one tenant, or no rate yet): ``(bytes ahead by
    lanes_ahead + nbytes - free) / the ledger's release rate``.
    """
    own = standings.get(tenant)
    shared = any(name != tenant and (s.waiting or s.in_flight) for name, s in standings.items())
    if own is not None and own.rate > 0 and shared:
        mine = [(p, c, waiters, nb) for p, c, owner, waiters, nb in lanes if owner == tenant]
        ahead, rate = bytes_ahead(mine, nbytes, priority, max_bypass), own.rate
    else:
        ahead = bytes_ahead(lanes_ahead(lanes, tenant, priority, standings), nbytes, priority, max_bypass)
        rate = release_rate
    return retry_after(max(0, round(ahead) + nbytes - free), rate, max_wait)


def size_class(nbytes: int) -> int:
    """Requests within a factor of two share a lane: ``nbytes.bit_length()``."""
    return nbytes.bit_length()
