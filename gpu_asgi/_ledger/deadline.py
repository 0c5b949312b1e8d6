"""Deadline-aware admission: the one rule both ledgers apply to a request that must queue.

A ledger calls :func:`unmeetable` at the moment it finds that a request cannot be granted
at once, before the request joins the queue, with that moment's state: the in-process ledger from
its own state, the Redis ledger from a snapshot the reserve script returns in the same atomic step
(docs/admission.md, "Deadlines"). The prediction is ``Retry-After``'s model
(``_prediction.predicted_wait``), so a refused client is told when to come back by the same
numbers that refused it.
"""

from __future__ import annotations

from collections.abc import Callable

from .._errors import DeadlineUnmeetable
from .drain import MIN_RETRY_AFTER


def unmeetable(wait_limit: float, release_rate: float, predict: Callable[[], float]) -> DeadlineUnmeetable | None:
    """The refusal (for the ledger to raise) of a request that waits at most ``wait_limit``
    seconds and is predicted (``predict()``: its ``Retry-After`` now) to wait longer; else None.

    Only a prediction from an observed drain rate (``release_rate`` > 0) refuses: before any
    release the ledger's hint is its ``max_wait`` fallback, which says nothing about this wait. A
    prediction at the 1 s floor cannot be told from a shorter wait, so it never refuses either.
    """
    if release_rate > 0:
        predicted = predict()
        if predicted > wait_limit and predicted > MIN_RETRY_AFTER:
            return DeadlineUnmeetable(
                f"The predicted wait for GPU memory is {predicted:.3g} s; this request waits at most {wait_limit:g} s.",
                retry_after=predicted,
                predicted_wait_seconds=round(predicted, 3),
            )
    return None
