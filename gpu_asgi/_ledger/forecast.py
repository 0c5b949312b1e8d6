"""How long until a request is admitted, the same for both ledgers: which queued bytes go before a
request arriving now, how long until it would be admitted (until the device has room and, for a
tenant with a quota, its own bytes have made room under it: ``Retry-After``), and the deadline
rule that refuses a request predicted to wait longer than its client will (docs/admission.md,
"Retry-After", "Retry-After with a quota" and "Deadlines").

Imports run one way: this module uses ``fair_share`` (``Standing``, ``lanes_ahead``) and
``drain`` (the rate and its clamp); neither imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from .._errors import DeadlineUnmeetable, QueueTimeout
from .drain import MIN_RETRY_AFTER, retry_after
from .fair_share import Standing, lanes_ahead


def unmeetable(deadline: float, predicted: float) -> DeadlineUnmeetable | None:
    """The refusal (for the ledger to raise) of a request that waits at most ``deadline`` seconds
    and is predicted to wait ``predicted`` seconds (its ``Retry-After`` now); else None.

    A ledger calls this at the moment it finds that a request cannot be granted at once, before
    the request joins the queue, with that moment's state: the in-process ledger from its own
    state, the Redis ledger from a snapshot the reserve script returns in the same atomic step.
    The prediction is :func:`predicted_wait`, so a refused client is told when to come back by the
    same numbers that refused it. Only a prediction from an observed drain rate refuses (the ledger
    asks only then): before any release the hint is the ``max_wait`` fallback, which says nothing
    about this wait. A prediction at the 1 s floor cannot be told from a shorter wait, so it never
    refuses either.
    """
    if predicted > deadline and predicted > MIN_RETRY_AFTER:
        return DeadlineUnmeetable(
            f"The predicted wait for GPU memory is {predicted:.3g} s; this request waits at most {deadline:g} s.",
            retry_after=predicted,
            predicted_wait_seconds=round(predicted, 3),
        )
    return None


def queue_timeout(nbytes: int, wait: float, retry_after: float, predicted: float | None) -> QueueTimeout:
    """The refusal of a request that waited ``wait`` seconds in the queue. ``predicted``: the wait
    the deadline rule let it queue on (None: it had none, before any drain rate or in a patient
    queue); where there was one, the prediction was wrong, and the refusal says by how much."""
    if predicted is None:
        return QueueTimeout(f"No GPU memory became free for {nbytes} bytes within {wait:g} s.", retry_after=retry_after)
    return QueueTimeout(
        f"No GPU memory became free for {nbytes} bytes within {wait:g} s (predicted: {predicted:.3g} s).",
        retry_after=retry_after,
        predicted_wait_seconds=round(predicted, 3),
    )


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
    quota: int | None = None,
) -> float:
    """``Retry-After`` for a request of ``tenant`` arriving now, the same in both ledgers.

    ``lanes`` are (priority, size class, tenant, waiters, bytes). While another tenant holds or
    waits and ``tenant`` has an admission rate (``Standing.rate``), its queue moves at that rate:
    ``(its own bytes ahead + nbytes - free) / its rate``. That rate already nets out what tenants
    ordered before it take, later arrivals with a lower virtual time included, which counting the
    bytes ahead now cannot. Otherwise (one tenant, or no rate yet): ``(bytes ahead by
    lanes_ahead + nbytes - free) / the ledger's release rate``.

    With a ``quota`` (the tenant's ``quota_bytes``), the request is admitted only once its own
    tenant's bytes have come back far enough too, so the wait is at least :func:`quota_wait`;
    where the quota does not bind, the prediction is the device's alone, unchanged.
    """
    own = standings.get(tenant)
    shared = any(name != tenant and (s.waiting or s.in_flight) for name, s in standings.items())
    if own is not None and own.rate > 0 and shared:
        ahead, rate = bytes_ahead(own_lanes(lanes, tenant), nbytes, priority, max_bypass), own.rate
    else:
        ahead = bytes_ahead(lanes_ahead(lanes, tenant, priority, standings), nbytes, priority, max_bypass)
        rate = release_rate
    wait = retry_after(max(0, round(ahead) + nbytes - free), rate, max_wait)
    if quota is None:
        return wait
    return max(wait, quota_wait(lanes, tenant, nbytes, priority, own, quota, release_rate, max_bypass, max_wait))


def quota_wait(
    lanes: Sequence[tuple[int, int, str, int, int]],
    tenant: str,
    nbytes: int,
    priority: int,
    own: Standing | None,
    quota: int,
    release_rate: float,
    max_bypass: int,
    max_wait: float,
) -> float:
    """The wait until ``tenant``'s quota has room for ``nbytes`` after its own waiters ahead:
    ``(its bytes held + its own bytes ahead + nbytes - quota) / its admission rate``; 0 when
    that is not positive (the quota does not bind).

    Only the tenant's own releases make room under its quota, whatever the device's free bytes.
    Its admission rate is the pace of those releases: while it waits at its quota, each of its
    waiters is admitted as its own bytes come back, and it is the rate both ledgers already keep
    per tenant. Until that rate is known, the ledger's release rate, the model's fallback for a
    tenant without one: the bytes coming back include the tenant's, so it errs toward a shorter
    wait, the safe side for a deadline decision. Without that either, ``max_wait``, as every
    ``Retry-After`` before a rate is known.
    """
    held = 0 if own is None else own.held
    ahead = bytes_ahead(own_lanes(lanes, tenant), nbytes, priority, max_bypass)
    over = held + round(ahead) + nbytes - quota
    if over <= 0:
        return 0.0
    rate = own.rate if own is not None and own.rate > 0 else release_rate
    return retry_after(over, rate, max_wait)


def own_lanes(lanes: Iterable[tuple[int, int, str, int, int]], tenant: str) -> list[tuple[int, int, int, int]]:
    """Of ``lanes`` (priority, size class, tenant, waiters, bytes), ``tenant``'s own, as
    (priority, size class, waiters, bytes) for ``bytes_ahead``."""
    return [(p, c, waiters, nb) for p, c, owner, waiters, nb in lanes if owner == tenant]


def size_class(nbytes: int) -> int:
    """Requests within a factor of two share a lane: ``nbytes.bit_length()``."""
    return nbytes.bit_length()
