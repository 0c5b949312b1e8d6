"""Deadline-aware admission: refuse at once a request whose predicted wait exceeds its deadline.

The prediction is ``Retry-After``'s model (``ledger.retry_after``), so a refused client is told
when to come back by the same numbers that refused it (docs/admission.md, "Deadlines").
"""

from __future__ import annotations

import math

from ._drain import MIN_RETRY_AFTER
from ._errors import DeadlineUnmeetable
from ._ledger import BudgetLedger
from ._tenancy import DEFAULT_TENANT


def queue_timeout(
    ledger: BudgetLedger, nbytes: int, priority: int, wait_limit: float, tenant: str = DEFAULT_TENANT
) -> float:
    """The queue timeout of a request that must queue and waits at most ``wait_limit`` seconds,
    or :class:`DeadlineUnmeetable` when the predicted wait is longer.

    Only a prediction from an observed drain rate refuses: before any release the ledger's hint is
    its ``max_wait`` fallback, which says nothing about this wait. A prediction at the 1 s floor
    cannot be told from a shorter wait, so it never refuses either.
    """
    if ledger.statistics().release_rate_bytes_per_second > 0:
        predicted = ledger.retry_after(nbytes, priority=priority, tenant=tenant)
        if predicted > wait_limit and predicted > MIN_RETRY_AFTER:
            raise DeadlineUnmeetable(
                f"The predicted wait for GPU memory is {predicted:.3g} s; this request waits at most {wait_limit:g} s.",
                retry_after=predicted,
                predicted_wait_seconds=round(predicted, 3),
            )
    return min(wait_limit, getattr(ledger, "max_wait", math.inf))
