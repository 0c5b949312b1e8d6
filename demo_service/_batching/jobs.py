"""``Generation``: one request's sequences inside the batcher, as the endpoint sees them.

The batcher drives it (``_start``, ``_accept`` per token, ``_device_finished`` or ``_fail``), all on
the event loop; the endpoint awaits :meth:`Generation.result` or iterates :meth:`Generation.deltas`,
and calls :meth:`Generation.cancel` when its client leaves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import SpanContext

from gpu_asgi import Reservation

from .decode import SequenceText
from .device_run import BatchPlan, Sampling

STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"


@dataclass(frozen=True, slots=True)
class Delta:
    """New text of one sequence (choice ``index``); ``finish_reason`` is set on its last delta."""

    index: int
    text: str
    finish_reason: str | None = None


class SequenceState:
    """One generated sequence: its prompt ids, its text so far, and why it ended."""

    __slots__ = ("finish_reason", "index", "prompt_ids", "slot", "text")

    def __init__(self, index: int, prompt_ids: list[int], text: SequenceText) -> None:
        self.index = index
        self.prompt_ids = prompt_ids
        self.text = text
        self.finish_reason: str | None = None
        #: Row in the batch's plan, once the batch starts.
        self.slot = -1

    @property
    def completion_tokens(self) -> int:
        return len(self.text.token_ids)


class Generation:
    """A request's sequences: ``n`` per prompt, generated in one batch, each with its own reservation."""

    def __init__(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_new_tokens: int,
        sampling: Sampling,
        stop: tuple[str, ...],
        reserved_bytes: int,
        tokenizer: Any,
        incremental: bool,
        link: SpanContext,
        reserved_tokens: int | None = None,
        reservation: Reservation | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.sequences = [
            SequenceState(i * n + j, prompt, SequenceText(tokenizer, stop, incremental=incremental))
            for i, prompt in enumerate(prompts)
            for j in range(n)
        ]
        #: Usage counts each prompt once, whatever ``n`` is (as OpenAI does).
        self.prompt_tokens = sum(map(len, prompts))
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.reserved_bytes = reserved_bytes
        #: New tokens per sequence the reservation covers: ``max_new_tokens`` (strict) or the
        #: learned prediction; a batch grows past it with bytes it waits for (``Batcher``).
        self.reserved_tokens = max_new_tokens if reserved_tokens is None else min(reserved_tokens, max_new_tokens)
        #: The request's own reservation: a running batch that must grow may take bytes from a
        #: request still queued here (its batch is not on the device yet) ...
        self.reservation = reservation
        #: ... and these are the bytes taken, which its batch gets back before it starts.
        self.owed = 0
        self.link = link
        self.created = loop.time()
        #: Rows in the ``generate`` call that ran this request (0 until it starts).
        self.batch_rows = 0
        self.first_token_at: float | None = None
        self.cancelled = False
        #: Batches formed without this request while it waited (the batcher bounds it).
        self.passes = 0
        #: True when its batch starts; False when it never will (cancelled, or the service stopped).
        self.started: asyncio.Future[bool] = loop.create_future()
        #: Done when the device has finished the batch: the request's memory is free from then on.
        self.device_done: asyncio.Future[None] = loop.create_future()
        self._events: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()
        self._unfinished = len(self.sequences)
        self._plan: BatchPlan | None = None
        self._submitted = time.perf_counter()

    @property
    def completion_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.sequences)

    @property
    def held_bytes(self) -> int:
        """What its reservation holds now: what it reserved, less what a running batch took."""
        return self.reserved_bytes - self.owed

    def lend(self, nbytes: int) -> int:
        """Give up to ``nbytes`` of a queued request's reservation to a running batch (see
        ``owed``); returns the bytes given."""
        if self.reservation is None or self._plan is not None or self.cancelled:
            return 0
        given = min(nbytes, self.held_bytes)
        if given > 0:
            self.owed += given
            self.reservation.shrink(self.held_bytes)
        return given

    @property
    def complete(self) -> bool:
        """Every sequence has ended (the batch may still be running for other requests)."""
        return self._unfinished == 0

    # -- for the endpoint -------------------------------------------------------------------------

    async def result(self) -> list[SequenceState]:
        """The finished sequences, once the device is done with their batch."""
        await asyncio.shield(self.device_done)
        return self.sequences

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text as it is generated, until every sequence has ended; raises if the batch failed."""
        while True:
            item = await self._events.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        """The client left: stop its sequences at the next step (or never start them)."""
        if self.cancelled or self.device_done.done():
            return
        self.cancelled = True
        for sequence in self.sequences:
            if sequence.finish_reason is None:
                self._finish(sequence, CANCELLED)
        if self._plan is None:  # never reached the device: nothing to wait for
            self.started.set_result(False)
            self.device_done.set_result(None)

    # -- driven by the batcher ----------------------------------------------------------------------

    def _start(self, plan: BatchPlan, offset: int, batch_rows: int) -> None:
        self._plan = plan
        self.batch_rows = batch_rows
        for i, sequence in enumerate(self.sequences):
            sequence.slot = offset + i
        if not self.started.done():
            self.started.set_result(True)

    def _accept(self, sequence: SequenceState, token: int, is_eos: bool) -> bool:
        """One new token of ``sequence``; returns whether it counts as generated text."""
        if is_eos:
            self._finish(sequence, STOP)
            return False
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        delta = sequence.text.push(token)
        if sequence.text.stopped:
            self._finish(sequence, STOP, delta)
        elif sequence.completion_tokens >= self.max_new_tokens:
            self._finish(sequence, LENGTH, delta)
        elif delta:
            self._events.put_nowait(Delta(sequence.index, delta))
        return True

    def _finish(self, sequence: SequenceState, reason: str, delta: str = "") -> None:
        sequence.finish_reason = reason
        tail = sequence.text.finish()
        if self._plan is not None:
            self._plan.halted[sequence.slot] = True  # stop spending the device on it
        if reason != CANCELLED:
            self._events.put_nowait(Delta(sequence.index, delta + tail, reason))
        self._unfinished -= 1
        if self._unfinished == 0:
            self._events.put_nowait(None)

    def _device_finished(self) -> None:
        for sequence in self.sequences:
            if sequence.finish_reason is None:  # generate stopped for a reason of its own (e.g. context length)
                self._finish(sequence, LENGTH)
        if not self.device_done.done():
            self.device_done.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if not self.started.done():
            self.started.set_result(False)
        if not self.device_done.done():
            self.device_done.set_exception(error)
            self.device_done.exception()  # retrieved: nobody may be awaiting a cancelled request
        if self._unfinished:
            self._unfinished = 0
            self._events.put_nowait(error)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self._submitted
