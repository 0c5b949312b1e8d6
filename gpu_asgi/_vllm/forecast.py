"""The KV blocks the ledger must hold for a set of running requests so that none is preempted.

vLLM's scheduler gives each running request one token per step (continuous batching), takes a
block when a token starts one, and frees all of a request's blocks when it ends. Each running
request is held at the blocks it holds now (its own reservation); one more reservation holds the
*growth*: the most blocks that the requests still running at any later step will have taken
beyond what they hold now, each forecast to end at a known length.

The growth of a request that has ended is not counted at later steps, but its held blocks are
never lent to the others: when a request ends, the ledger gives its bytes back to whoever waits,
so the requests left must be covered by their own reservations and the growth alone, whichever
requests end first, and whenever (an answer may end long before its forecast). A request that
starts later is not in the set: admission reserves its own peak for it (``prompt`` plus its
forecast length), which is never less than what it adds to the held blocks and the growth, so
what the ledger must hold stays within what it holds (docs/vllm.md, "Reservations that follow
the answers").
"""

from __future__ import annotations

from collections.abc import Iterable
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


def peak_blocks(running: Iterable[Running], block_size: int) -> tuple[int, int]:
    """``(now, peak)``: the blocks the requests hold now, and those the ledger must hold for them:
    ``now`` plus the most that the requests still running at any step from now on will have
    taken beyond what they hold now (each gains a token per step until its forecast end)."""
    now = 0
    events: list[tuple[int, int]] = []  # (step, change of the growth)
    for request in running:
        held, end = min(request.held, request.end), request.end
        first = blocks(held, block_size)
        now += first * request.sequences
        last_step = request.steps - 1
        # A new block is taken at the step whose token is the first past a block's end.
        for boundary in range(first * block_size, blocks(end, block_size) * block_size, block_size):
            step = boundary + 1 - held
            if step > last_step:
                break
            events.append((step, request.sequences))
        grown = blocks(min(held + last_step, end), block_size) - first
        if grown:
            events.append((request.steps, -grown * request.sequences))
    # At one step, the blocks taken come before those freed: under async scheduling vLLM may
    # schedule a step before it has freed the blocks of a request that ended in the step before.
    events.sort(key=lambda event: (event[0], -event[1]))
    growth = most = 0
    for _, change in events:
        growth += change
        most = max(most, growth)
    return now, now + most
