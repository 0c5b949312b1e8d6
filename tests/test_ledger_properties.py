"""Hypothesis stateful test of the ledger: never over-committed, nothing leaked, FIFO up to the bounded bypass."""

from __future__ import annotations

import asyncio

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpu_asgi import Ledger, NeverFits, Reservation

CAPACITY = 100
MAX_BYPASS = 3


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.ledger: Ledger
        self.waiting: dict[int, tuple[int, asyncio.Task[Reservation]]] = {}  # arrival -> (nbytes, task)
        self.held: list[Reservation] = []
        self.arrivals = 0
        self.head: int | None = None
        self.head_passed = 0

    @initialize(max_queue=st.integers(1, 12))
    def setup(self, max_queue: int) -> None:
        self.ledger = Ledger(CAPACITY, max_queue=max_queue, max_bypass=MAX_BYPASS, max_wait=3600)

    def settle(self) -> None:
        async def spin() -> None:
            for _ in range(10):
                await asyncio.sleep(0)

        self.loop.run_until_complete(spin())
        granted = []
        for arrival, (_, task) in list(self.waiting.items()):
            if task.done():
                del self.waiting[arrival]
                if not task.cancelled() and task.exception() is None:
                    granted.append((int(task.result().id[1:]), arrival, task.result()))
                elif arrival == self.head:
                    self.head = None  # the head left unserved (cancelled): what follows did not pass it
        # Grants in the order the ledger made them (ids increase); count those that passed the head.
        for _, arrival, reservation in sorted(granted):
            self.held.append(reservation)
            if self.head is not None and arrival != self.head and arrival > self.head:
                self.head_passed += 1
                assert self.head_passed <= MAX_BYPASS, "the head was passed more than max_bypass times"
            if arrival == self.head:
                self.head = None
        new_head = min(self.waiting, default=None)
        if new_head != self.head:
            self.head, self.head_passed = new_head, 0

    @rule(nbytes=st.integers(0, CAPACITY))
    def arrive(self, nbytes: int) -> None:
        self.arrivals += 1
        full = self.ledger.statistics().waiting >= self.ledger.max_queue
        task = self.loop.create_task(self.ledger.reserve(nbytes))
        self.waiting[self.arrivals] = (nbytes, task)
        self.settle()
        if task.done() and not task.cancelled() and task.exception() is not None:
            assert full, f"rejected with {task.exception()!r} although the queue had room"

    @rule(nbytes=st.integers(CAPACITY + 1, 10 * CAPACITY))
    def arrive_too_large(self, nbytes: int) -> None:
        task = self.loop.create_task(self.ledger.reserve(nbytes))
        self.loop.run_until_complete(asyncio.wait([task]))
        assert isinstance(task.exception(), NeverFits)

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 1000))
    def release(self, index: int) -> None:
        self.held.pop(index % len(self.held)).release()
        self.settle()

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 1000), keep=st.floats(0, 1))
    def shrink(self, index: int, keep: float) -> None:
        reservation = self.held[index % len(self.held)]
        reservation.shrink(int(reservation.nbytes * keep))
        self.settle()

    @precondition(lambda self: self.waiting)
    @rule(index=st.integers(0, 1000))
    def cancel(self, index: int) -> None:
        arrival = sorted(self.waiting)[index % len(self.waiting)]
        self.waiting[arrival][1].cancel()
        self.settle()

    @invariant()
    def never_over_committed(self) -> None:
        if not hasattr(self, "ledger"):
            return
        stats = self.ledger.statistics()
        held = sum(r.nbytes for r in self.held)
        assert stats.reserved_bytes == held
        assert 0 <= held <= CAPACITY
        assert stats.in_flight == len(self.held)
        assert stats.waiting == len(self.waiting)

    @invariant()
    def head_waits_only_when_it_does_not_fit(self) -> None:
        if not hasattr(self, "ledger") or not self.waiting:
            return
        head_bytes = self.waiting[min(self.waiting)][0]
        assert head_bytes > CAPACITY - self.ledger.statistics().reserved_bytes

    def teardown(self) -> None:
        if hasattr(self, "ledger"):
            for _, task in self.waiting.values():
                task.cancel()
            self.settle()
            for reservation in self.held:
                reservation.release()
            stats = self.ledger.statistics()
            assert stats.reserved_bytes == 0 and stats.waiting == 0 and stats.in_flight == 0
        self.loop.close()


LedgerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestLedgerStateMachine = LedgerMachine.TestCase
