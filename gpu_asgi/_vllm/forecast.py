"""The KV blocks the ledger must hold for a set of running requests so that none is preempted.

vLLM's scheduler gives each running request one token per step (continuous batching), takes a
block when a token starts one, and frees all of a request's blocks when it ends. Each running
request is held at the blocks it holds now (its own reservation); one more reservation holds the
rest of what the set needs.

With all of the growth (``quantile`` None, ``GPU_ASGI_GROWTH=all``) each request is forecast to
end at a known length, and the rest is the *growth*: the most blocks that the requests still
running at any later step will have taken beyond what they hold now. The growth of a request that
has ended is not counted at later steps, but its held blocks are never lent to the others: when a
request ends, the ledger gives its bytes back to whoever waits, so the requests left must be
covered by their own reservations and the growth alone, whichever requests end first, and whenever
(an answer may end long before its forecast). A request that starts later is not in the set:
admission reserves its own peak for it (``prompt`` plus its forecast length), which is never less
than what it adds to the held blocks and the growth, so what the ledger must hold stays within
what it holds (docs/vllm.md, "Reservations that follow the answers").

With a ``quantile`` below 1 (``GPU_ASGI_GROWTH``, pooled) each request is forecast to its declared
limit, going on to each later step only with the chance its route's answers that got as far went
on (``Running.going_on``), and what the set needs is the most blocks, at any step, of the requests
still running then: that quantile of it, the answers taken as independent. Several rarely all run
long, and an answer likely to end by then lends its blocks to the growth of those that outlive it;
so a request's bytes must not go back to the ledger when it ends, but to the reservation that holds
the rest (``Reservation.hand_over``), until the next reading counts the set again. A miss (more
blocks than held) costs a preemption.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from statistics import NormalDist

from .._estimate.paged import blocks_for as blocks

__all__ = ["Running", "peak_blocks"]


@dataclass(frozen=True, slots=True)
class Running:
    """One admitted request as the forecast sees it; token counts are per sequence."""

    #: Tokens its blocks hold now: prompt, tokens generated, and those it may generate before the
    #: next reading (at most ``end``).
    held: int
    #: Tokens at its forecast end: prompt plus forecast length (at least ``held``).
    end: int
    #: Steps until that end (at least 1): it holds blocks in steps ``0 .. steps - 1``.
    steps: int
    #: Sequences it generates (``n``), each with blocks of its own.
    sequences: int = 1
    #: The chance it is still running ``s`` steps from now (None: certainly, until ``steps``).
    going_on: Callable[[int], float] | None = None


@dataclass(frozen=True, slots=True)
class _Takes:
    """The blocks one request holds now and the further ones it takes, per sequence: one at
    ``start`` and every ``block_size`` steps after, ``count`` in all, while it runs."""

    first: int
    start: int
    count: int

    def by(self, step: int, block_size: int) -> int:
        """Blocks taken beyond ``first`` at steps up to ``step``."""
        return 0 if step < self.start else min(self.count, (step - self.start) // block_size + 1)


def _taken(request: Running, block_size: int) -> _Takes:
    held, end = min(request.held, request.end), request.end
    first = blocks(held, block_size)
    # A new block is taken at the step whose token is the first past a block's end: block
    # boundaries are block_size tokens apart, so are the steps; none after its last step.
    start = first * block_size + 1 - held
    count = 0 if start > request.steps - 1 else min(
        blocks(end, block_size) - first, (request.steps - 1 - start) // block_size + 1
    )
    return _Takes(first, start, max(0, count))


def peak_blocks(running: Iterable[Running], block_size: int, quantile: float | None = None) -> tuple[int, int]:
    """``(now, peak)``: the blocks the requests hold now, and those the ledger must hold for them:
    ``now`` plus the most that the requests still running at any step from now on will have
    taken beyond what they hold now (each gains a token per step until its forecast end). With a
    ``quantile`` below 1, the quantile of the most blocks the requests still running at any step
    hold then, each running on by chance, their held blocks lent to others once they may have
    ended (at least ``now``)."""
    running = list(running)
    takes = [_taken(request, block_size) for request in running]
    if quantile is not None and quantile < 1:
        return _pooled(running, takes, block_size, quantile)
    return _all_growth(running, takes, block_size)


def _all_growth(running: list[Running], takes: list[_Takes], block_size: int) -> tuple[int, int]:
    """:func:`peak_blocks` with all of the growth: every request runs to its forecast end.

    At one step the blocks taken come before those freed: under async scheduling vLLM may schedule
    a step before it has freed the blocks of a request that ended in the step before. The growth
    only rises between two ends, so it is most at one of them: counted there, or, where the steps
    are fewer than the requests squared, step by step (each request's takes a run every
    ``block_size`` steps, summed as a difference array with that stride)."""
    now = sum(take.first * request.sequences for request, take in zip(running, takes))
    growing = [(request.steps, take, request.sequences) for request, take in zip(running, takes) if take.count]
    horizon = max((steps for steps, _, _ in growing), default=0)
    if len(growing) ** 2 <= horizon:
        most = max(
            (sum(take.by(end, block_size) * n for steps, take, n in growing if steps >= end) for end, _, _ in growing),
            default=0,
        )
        return now, now + most
    runs, freed = [0] * (horizon + 1), [0] * (horizon + 1)
    for steps, take, n in growing:
        runs[take.start] += n
        stop = take.start + take.count * block_size
        if stop <= horizon:
            runs[stop] -= n
        freed[steps] += take.count * n
    growth = most = 0
    for step in range(horizon + 1):
        if step >= block_size:
            runs[step] += runs[step - block_size]
        growth += runs[step]
        most = max(most, growth)
        growth -= freed[step]
    return now, now + most


#: About the most counts pooled growth makes of the set; past it, steps are counted together.
MAX_POINTS = 48
#: The most ``answers x blocks`` the exact distribution of the sum is computed for; past it, a
#: normal approximation corrected for skew (GPU block sizes of 16 tokens, hundreds of answers).
MAX_EXACT = 4_000


def _pooled(running: list[Running], takes: list[_Takes], block_size: int, quantile: float) -> tuple[int, int]:
    """:func:`peak_blocks` with each request counted at a step only with the chance it is still
    running then, its held blocks as well as its growth: the ``quantile`` of the blocks the set
    holds, at the step where that is most (now, or a step where a block is taken).

    The work is bounded whatever the block size and the answers' limits: about ``MAX_POINTS``
    counts. Past that many steps where blocks are taken, the steps are counted together, a few
    near now and more further on; a count that stands for several takes each request's blocks at
    the last of them and its chance at the first, never less than at any of them, so the set is
    held at no less than an exact count would, and at no more than all of the growth."""
    now = sum(take.first * request.sequences for request, take in zip(running, takes))
    groups = _groups(takes, block_size)
    weights: list[list[int]] = [[] for _ in groups]
    chances: list[list[float]] = [[] for _ in groups]
    for request, take in zip(running, takes):
        going_on = request.going_on
        for k, (early, late) in enumerate(groups):
            if early > request.steps:  # ended (freed after the takes of its last step)
                break
            # Its blocks are held at a step if it ran in the step before: vLLM may free them a
            # step late, as the exact count (the takes before the frees) assumes.
            chance = 1.0 if going_on is None else min(1.0, going_on(max(0, early - 1)))
            if chance <= 0:
                break  # it will not run on to a later step either
            weights[k].append((take.first + take.by(late, block_size)) * request.sequences)
            chances[k].append(chance)
    # Counted likeliest-largest first, each skipped where a bound on its quantile (Cantelli's,
    # or every answer going on) is no more than the most counted so far: most are skipped.
    spread = math.sqrt(quantile / (1 - quantile))
    bounds = []
    for group_weights, group_chances in zip(weights, chances):
        mean, variance, _ = _moments(group_weights, group_chances)
        bounds.append((min(sum(group_weights), mean + spread * math.sqrt(variance)), mean, group_weights, group_chances))
    bounds.sort(key=lambda bound: -bound[1])
    most = now
    for bound, _, group_weights, group_chances in bounds:
        if bound > most:
            most = max(most, _quantile_of_sum(group_weights, group_chances, quantile))
    if any(early != late for early, late in groups):  # counted together: bounded by all of the growth
        most = min(most, _all_growth(running, takes, block_size)[1])
    return now, most


def _groups(takes: list[_Takes], block_size: int) -> list[tuple[int, int]]:
    """``(first, last)`` steps of each count: every step where a block is taken, apart, while
    there are at most ``MAX_POINTS``; else runs of steps, each ending where the steps have grown
    by a constant ratio since its first (a few near now, more further on)."""
    if sum(take.count for take in takes) <= MAX_POINTS:
        steps = sorted({take.start + j * block_size for take in takes for j in range(take.count)})
        return [(step, step) for step in steps]
    first = min(take.start for take in takes if take.count)
    last = max(take.start + (take.count - 1) * block_size for take in takes if take.count)
    ratio = (last / max(1, first)) ** (1 / MAX_POINTS)
    groups, step = [], first
    while step <= last:
        end = max(step, math.floor(step * ratio))
        groups.append((step, min(end, last)))
        step = end + 1
    return groups


#: Below this many answers the normal approximation is poor (off by 5-12% of the sum's largest
#: value at 8-12 answers): their weights are rounded up instead, to fit ``MAX_EXACT``.
MIN_APPROXIMATED = 16


def _quantile_of_sum(weights: list[int], chances: list[float], quantile: float) -> int:
    """The ``quantile`` of the sum of ``weights[i]``, each counted with chance ``chances[i]``
    (independently): the least total at or above which a share ``1 - quantile`` lies. The certain
    ones are added as they are; of the others, exact up to ``MAX_EXACT`` (weights times their
    sum); past it, with fewer than ``MIN_APPROXIMATED`` of them, exact on the weights rounded up to
    a power of two that fits (never less, nor more than all of them); else the Cornish-Fisher
    expansion of its first three moments."""
    certain = sum(weight for weight, chance in zip(weights, chances) if chance >= 1)
    chancy = [(weight, chance) for weight, chance in zip(weights, chances) if 0 < chance < 1]
    if not chancy:
        return certain
    weights, chances = [weight for weight, _ in chancy], [chance for _, chance in chancy]
    total, count = sum(weights), len(weights)
    if count * total <= MAX_EXACT:
        return certain + _exact_quantile(weights, chances, quantile)
    if count < MIN_APPROXIMATED:
        unit = 1
        while count * (total // unit + count) > MAX_EXACT:
            unit *= 2  # a power of two: a larger sum is never rounded to less
        rounded = unit * _exact_quantile([-(-weight // unit) for weight in weights], chances, quantile)
        return certain + min(total, rounded)
    return certain + _approximate_quantile(weights, chances, quantile, total)


def _exact_quantile(weights: list[int], chances: list[float], quantile: float) -> int:
    spread = [1.0] + [0.0] * sum(weights)  # spread[k]: the chance the sum is k
    top = 0
    for weight, chance in zip(weights, chances):
        if chance <= 0:
            continue
        top += weight
        for k in range(top, weight - 1, -1):
            spread[k] = spread[k] * (1 - chance) + spread[k - weight] * chance
        for k in range(weight - 1, -1, -1):
            spread[k] *= 1 - chance
    below = 0.0
    for total, share in enumerate(spread[: top + 1]):
        below += share
        if below >= quantile - 1e-12:
            return total
    return top


def _approximate_quantile(weights: list[int], chances: list[float], quantile: float, total: int) -> int:
    """The normal quantile of the sum's mean and variance, corrected for its skew (many answers
    each rarely running long make a sum skewed to the right), rounded up, within ``0 .. total``."""
    mean, variance, third = _moments(weights, chances)
    if variance <= 0:
        return min(total, math.ceil(mean - 1e-9))
    z = NormalDist().inv_cdf(quantile)
    skew = third / (variance * math.sqrt(variance))
    z += (z * z - 1) * skew / 6
    return max(0, min(total, math.ceil(mean + z * math.sqrt(variance) - 1e-9)))


def _moments(weights: list[int], chances: list[float]) -> tuple[float, float, float]:
    """The sum's mean, variance and third central moment (each weight counted with its chance)."""
    mean = variance = third = 0.0
    for weight, chance in zip(weights, chances):
        spread = chance * (1 - chance)
        mean += weight * chance
        variance += weight * weight * spread
        third += weight**3 * spread * (1 - 2 * chance)
    return mean, variance, third
