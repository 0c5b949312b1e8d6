"""The most KV blocks a set of running requests will hold together, at any engine step from now.

vLLM's scheduler gives each running request one token per step (continuous batching), takes a
block when a token starts one, and frees all of a request's blocks when it ends. So if each
request is forecast to end at a known length, the blocks the set holds at every future step are
known, and their peak is what must fit the cache for nobody to be preempted. A request that
starts later is not in the set: admission reserves its own peak for it (``prompt`` plus its
forecast length), which is never less than what it adds to the set's peak at any step, so the
new peak stays within what the ledger holds (docs/vllm.md, "Reservations that follow the answers").
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
    """``(now, peak)``: the blocks the requests hold now, and the most they hold at any step from
    now on, each gaining a token per step until its forecast end and then freeing its blocks
    (vLLM frees a finished request's blocks before it schedules the next step)."""
    now = 0
    events: list[tuple[int, int]] = []  # (step, change)
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
        last = blocks(min(held + last_step, end), block_size)
        events.append((request.steps, -last * request.sequences))
    events.sort()  # at one step, the blocks freed come before those taken
    total = peak = now
    for _, change in events:
        total += change
        peak = max(peak, total)
    return now, peak
