"""Which queued requests run together in the next ``generate``.

Candidates are a batch anchored on the oldest request and one anchored on the oldest request of
each other (sampling, prompt bucket, length bucket); each anchor takes every other queued request,
in arrival order, that has its sampling parameters, fits in ``max_batch_size`` rows, and whose
padding is paid for: a left-padded batch costs what its longest row costs, times the rows, and the
requests' reservations (plus at most ``spare`` borrowed bytes) must cover that. The candidate with
the most rows wins, ties to the oldest request's; a request passed over ``MAX_PASSES`` times anchors
the next batch itself, so none waits for ever behind requests that batch better.

A request admitted on a learned length reserved fewer new tokens than its limit
(``reserved_tokens``): the batch is costed at those, and grows while it runs (``Batcher``). For that
growth always to be possible, a batch is formed only of requests whose limits, all together, fit
the device (``capacity``).
"""

from __future__ import annotations

from .buckets import BucketedEstimator, bucket
from .jobs import Generation

#: A request passed over this many times anchors the next batch, whatever batches better.
MAX_PASSES = 4


def choose_batch(
    pending: list[Generation],
    *,
    max_batch_size: int,
    estimator: BucketedEstimator | None,
    spare: int,
    capacity: int | None = None,
) -> tuple[list[Generation], int]:
    """The next batch from ``pending`` (oldest first), and the bytes it must borrow: padding, and
    what a running batch took from its requests (``Generation.owed``)."""
    if not pending:
        return [], 0
    overdue = [i for i, g in enumerate(pending) if g.passes >= MAX_PASSES]
    best: tuple[list[Generation], int] | None = None
    for anchor in overdue[:1] or _anchors(pending):
        candidate = _gather(pending, anchor, max_batch_size, estimator, spare, capacity)
        if best is None or rows(candidate[0]) > rows(best[0]):
            best = candidate
    assert best is not None
    return best


def rows(batch: list[Generation]) -> int:
    return sum(len(g.sequences) for g in batch)


def _anchors(pending: list[Generation]) -> list[int]:
    """The oldest request, and the oldest of every other (sampling, prompt bucket, length bucket)."""
    seen: set[tuple[object, ...]] = set()
    anchors = []
    for index, generation in enumerate(pending):
        key = (
            generation.sampling.key,
            bucket(max(len(s.prompt_ids) for s in generation.sequences)),
            bucket(generation.max_new_tokens),
        )
        if key not in seen:
            seen.add(key)
            anchors.append(index)
    return anchors


def _gather(
    pending: list[Generation],
    anchor: int,
    max_batch_size: int,
    estimator: BucketedEstimator | None,
    spare: int,
    capacity: int | None,
) -> tuple[list[Generation], int]:
    """``pending[anchor]`` and every request that may join it; and the bytes missing."""
    head = pending[anchor]
    batch = [head]
    prompts = [len(s.prompt_ids) for s in head.sequences]
    reserved = [head.reserved_tokens] * len(prompts)
    limits = [head.max_new_tokens] * len(prompts)
    covered = head.held_bytes
    missing = 0 if estimator is None else max(0, estimator.batch_bytes(prompts, reserved) - covered)
    for candidate in pending:
        size = len(candidate.sequences)
        if candidate is head or candidate.sampling.key != head.sampling.key or len(prompts) + size > max_batch_size:
            continue
        more_prompts = prompts + [len(s.prompt_ids) for s in candidate.sequences]
        more_reserved = reserved + [candidate.reserved_tokens] * size
        more_limits = limits + [candidate.max_new_tokens] * size
        more_covered = covered + candidate.held_bytes
        more_missing = missing
        if estimator is not None:
            more_missing = max(0, estimator.batch_bytes(more_prompts, more_reserved) - more_covered)
            if more_missing > max(spare, missing):  # its padding costs more than was reserved and can be borrowed
                continue
            if capacity is not None and more_reserved != more_limits:
                if estimator.batch_bytes(more_prompts, more_limits) > capacity:  # could never grow to its limits
                    continue
        batch.append(candidate)
        prompts, reserved, limits, covered, missing = more_prompts, more_reserved, more_limits, more_covered, more_missing
    return batch, missing
