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

from collections.abc import Callable, Iterable
from dataclasses import dataclass

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


def _taken(request: Running, block_size: int) -> tuple[int, list[int]]:
    """``(blocks now, the steps at which it takes each further block)``, per sequence."""
    held, end = min(request.held, request.end), request.end
    first = blocks(held, block_size)
    steps = []
    # A new block is taken at the step whose token is the first past a block's end.
    for boundary in range(first * block_size, blocks(end, block_size) * block_size, block_size):
        step = boundary + 1 - held
        if step > request.steps - 1:
            break
        steps.append(step)
    return first, steps


def peak_blocks(running: Iterable[Running], block_size: int, quantile: float | None = None) -> tuple[int, int]:
    """``(now, peak)``: the blocks the requests hold now, and those the ledger must hold for them:
    ``now`` plus the most that the requests still running at any step from now on will have
    taken beyond what they hold now (each gains a token per step until its forecast end). With a
    ``quantile`` below 1, the quantile of the most blocks the requests still running at any step
    hold then, each running on by chance, their held blocks lent to others once they may have
    ended (at least ``now``)."""
    running = list(running)
    if quantile is not None and quantile < 1:
        return _pooled(running, block_size, quantile)
    now = 0
    events: list[tuple[int, int]] = []  # (step, change of the growth)
    for request in running:
        first, taken = _taken(request, block_size)
        now += first * request.sequences
        events += [(step, request.sequences) for step in taken]
        if taken:
            events.append((request.steps, -len(taken) * request.sequences))
    # At one step, the blocks taken come before those freed: under async scheduling vLLM may
    # schedule a step before it has freed the blocks of a request that ended in the step before.
    events.sort(key=lambda event: (event[0], -event[1]))
    growth = most = 0
    for _, change in events:
        growth += change
        most = max(most, growth)
    return now, now + most


def _pooled(running: list[Running], block_size: int, quantile: float) -> tuple[int, int]:
    """:func:`peak_blocks` with each request counted at a step only with the chance it is still
    running then, its held blocks as well as its growth: the ``quantile`` of the blocks the set
    holds, at the step where that is most (now, or a step where a block is taken)."""
    now, curves = 0, []
    for request in running:
        first, taken = _taken(request, block_size)
        now += first * request.sequences
        curves.append((request, first, taken))
    most = now
    for step in sorted({step for _, _, taken in curves for step in taken}):
        weights, chances = [], []
        for request, first, taken in curves:
            if step > request.steps:  # ended (freed after the takes of its last step)
                continue
            weights.append((first + sum(1 for s in taken if s <= step)) * request.sequences)
            # Its blocks are held at this step if it ran in the step before: vLLM may free them a
            # step late, as the exact count (the takes before the frees) assumes.
            chance = 1.0 if request.going_on is None else request.going_on(max(0, step - 1))
            chances.append(min(1.0, max(0.0, chance)))
        most = max(most, _quantile_of_sum(weights, chances, quantile))
    return now, most


def _quantile_of_sum(weights: list[int], chances: list[float], quantile: float) -> int:
    """The ``quantile`` of the sum of ``weights[i]``, each counted with chance ``chances[i]``
    (independently): the least total at or above which a share ``1 - quantile`` lies."""
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
