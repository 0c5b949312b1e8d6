"""Dynamic batching: admitted requests share one ``generate`` call, each keeping its own reservation.

``Batcher.submit`` queues a request's sequences and returns a :class:`Generation` handle. A collector
task waits until the oldest queued request is ``window`` seconds old (or ``max_batch_size`` sequences
are queued), then picks a batch (``_forming.choose_batch``): requests with the same sampling
parameters, lengths whose left-padded batch the requests' reservations cover, or, for the
difference, bytes borrowed from the ledger while they are free. The rows run in ONE ``generate`` on
the device executor's thread; each decoding step's tokens come back to the event loop and are split
per request, so streaming works inside a batch. While a batch runs new requests accumulate, so
under load batches fill without waiting for the window at all.

Every request's bytes stay reserved (by the middleware) until its batch has left the device: a
non-streamed result is handed out only then, and a stream sends ``[DONE]`` when its sequences end
but closes only when the batch ends (see ``_service.py``).

Learned lengths (``DEMO_RESERVE=learned``): a request reserves the new tokens its answer will
likely need, not its limit. Its batch is costed at those; before the device decodes a step the
batch's bytes do not cover, the device thread pauses while the batch borrows the bytes for the next
stretch from the ledger (ahead of the queue, ``GROWTH_PRIORITY``). Nothing is decoded on bytes
nobody holds, so an OOM stays impossible. Requests admitted and still queued here hold bytes the
device does not use yet: when the ledger has none free, the running batch takes them from the
youngest of those (``Generation.lend``), and each gets them back before its own batch starts. A
batch that cannot grow within the ledger's ``max_wait`` ends there: its unfinished answers end
with ``finish_reason: length`` (docs/demo.md, "Learned lengths").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Self

from opentelemetry import trace
from opentelemetry.trace import TracerProvider

from gpu_asgi import (
    MAX_PRIORITY,
    AdmissionRejected,
    BudgetLedger,
    DeviceExecutor,
    DeviceStatistics,
    QueueFull,
    Reservation,
    gpu_phase,
)

from .._metrics import DemoMetrics
from .._model.load import LoadedModel
from .buckets import BucketedEstimator
from .device_run import BatchPlan, Sampling, run_batch
from .forming import choose_batch
from .jobs import Generation, SequenceState

BATCH_SPAN = "demo_service.batch"
#: Padding loans come before any route's requests, and wait BORROW_TIMEOUT seconds at most (not at
#: all when the ledger predicts a longer wait: the deadline rule).
BORROW_PRIORITY = MAX_PRIORITY
BORROW_TIMEOUT = 0.05
#: A running batch's growth comes before everything: the device is waiting for it.
GROWTH_PRIORITY = MAX_PRIORITY
#: A batch grows by at least this many tokens per row at a time, and by a quarter of what it has.
GROWTH_STEP = 16

logger = logging.getLogger("demo_service.batching")


class BatchFormingFailed(RuntimeError):
    """The collector could not form a batch; the requests it held fail with this (a 500 problem)."""


class Batcher:
    """Collects admitted requests for ``window`` seconds and runs them in batches of up to ``max_batch_size`` rows."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        estimator: BucketedEstimator | None = None,
        ledger: BudgetLedger | None = None,
        executor: DeviceExecutor | None = None,
        window: float = 0.01,
        max_batch_size: int = 16,
        metrics: DemoMetrics | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        if window < 0 or max_batch_size < 1:
            raise ValueError("need window >= 0 and max_batch_size >= 1")
        self.loaded = loaded
        self.estimator = estimator
        self.ledger = ledger
        self.window = window
        self.max_batch_size = max_batch_size
        self.metrics = metrics
        self._tracer_provider = tracer_provider
        self._tracer = trace.get_tracer("demo_service", tracer_provider=tracer_provider)
        self._executor = executor if executor is not None else DeviceExecutor(loaded.device)
        eos = loaded.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if loaded.tokenizer.eos_token_id is not None:
            eos_ids.add(loaded.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos_ids)
        self._pending: deque[Generation] = deque()
        self._pending_rows = 0
        self._nonempty = asyncio.Event()
        self._full = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._tracing: set[asyncio.Future[None]] = set()
        #: ``generate`` calls made, the rows of each, and tokens generated (for tests and the benchmark).
        self.generate_calls = 0
        self.batch_sizes: deque[int] = deque(maxlen=10_000)
        self.tokens_generated = 0
        self._running = False
        #: The batch on the device: the bytes it holds and the rows' prompt lengths (benchmarks check
        #: each step against them).
        self.current: RunningBatch | None = None

    @property
    def idle(self) -> bool:
        """No batch on the device and nothing queued."""
        return not self._running and not self._pending

    def __repr__(self) -> str:
        return f"Batcher({self.loaded.name}, window={self.window}, max_batch_size={self.max_batch_size})"

    # -- requests -------------------------------------------------------------------------------

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        n: int = 1,
        sampling: Sampling | None = None,
        stop: Sequence[str] = (),
        reserved_bytes: int = 0,
        stream: bool = False,
        reserved_tokens: int | None = None,
        reservation: Reservation | None = None,
    ) -> Generation:
        """Queue ``n`` sequences per prompt; choice ``i * n + j`` is prompt ``i``'s ``j``-th sequence."""
        if self._task is None or self._task.done():
            raise RuntimeError("the batcher is not running (use it inside `async with batcher:`)")
        generation = Generation(
            [list(p) for p in prompts],
            n=n,
            max_new_tokens=max_new_tokens,
            sampling=sampling if sampling is not None else Sampling(),
            stop=tuple(stop),
            reserved_bytes=reserved_bytes,
            tokenizer=self.loaded.tokenizer,
            incremental=stream,
            link=trace.get_current_span().get_span_context(),
            reserved_tokens=reserved_tokens,
            reservation=reservation,
        )
        self._pending.append(generation)
        self._pending_rows += len(generation.sequences)
        self._nonempty.set()
        if self._pending_rows >= self.max_batch_size:
            self._full.set()
        # Created here, in the caller's context: the request's spans nest under its server span.
        tracing = asyncio.ensure_future(self._trace(generation))
        self._tracing.add(tracing)
        tracing.add_done_callback(self._tracing.discard)
        return generation

    async def warm_up(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        """One real ``generate`` on the device, outside any batch and any count, so that the first
        request does not pay for the first kernels and lazy initialisation."""
        plan = BatchPlan([list(prompt_ids)], [max_new_tokens], Sampling())
        await self._executor.run(run_batch, self.loaded, plan, lambda tokens: None)

    async def _trace(self, generation: Generation) -> None:
        provider = self._tracer_provider
        attributes = {"demo_service.sequences": len(generation.sequences)}
        with gpu_phase("batch_wait", attributes=attributes, tracer_provider=provider):
            started = await asyncio.shield(generation.started)
        if not started:
            return
        with gpu_phase(
            "generate",
            batch=generation.batch_rows,
            tokens_in=generation.prompt_tokens,
            max_new_tokens=generation.max_new_tokens,
            model=self.loaded.name,
            tracer_provider=provider,
        ) as phase:
            with contextlib.suppress(Exception):
                await asyncio.shield(generation.device_done)
            phase.set(tokens_out=generation.completion_tokens)

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None or self._task.done():
            # Fresh events: an app may be started again on another event loop (tests do).
            self._nonempty, self._full = asyncio.Event(), asyncio.Event()
            if self._pending:
                self._nonempty.set()
            self._task = asyncio.create_task(self._run(), name="demo_service-batcher")

    async def close(self) -> None:
        """Stop collecting; requests not yet on the device fail with ``RuntimeError``."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        while self._pending:
            self._pending.popleft()._fail(RuntimeError("the service is shutting down"))
        self._pending_rows = 0
        await asyncio.to_thread(self._executor.shutdown)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the collector ----------------------------------------------------------------------------

    async def _run(self) -> None:
        """Collect and run batches until closed. It never dies of an error: a batch it cannot form
        fails the requests waiting for one at once (their endpoints answer 500, and the middleware
        gives their bytes back), any loan goes back, and collecting goes on."""
        loop = asyncio.get_running_loop()
        while True:
            await self._nonempty.wait()
            remaining = self._pending[0].created + self.window - loop.time()
            if remaining > 0 and self._pending_rows < self.max_batch_size:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), remaining)
            loans: list[Reservation] = []
            try:
                batch, missing = self._choose(self._spare_bytes())
                loan = await self._borrow(missing) if missing else None
                if missing and loan is None:  # the bytes went elsewhere meanwhile: pad nothing
                    batch, missing = self._choose(0)
                    # What is still missing was taken by a batch that had to grow: it must come back.
                    loan = await self._acquire(missing, keep=batch) if missing else None
                    if missing and loan is None:
                        continue  # nothing came free within max_wait: the requests wait on
                if loan is not None:
                    loans.append(loan)
            except Exception as exc:
                logger.exception("the batcher could not form a batch; failing the requests waiting for one")
                for loan in loans:
                    loan.release()
                self._fail_pending(BatchFormingFailed(f"no batch could be formed ({type(exc).__name__}: {exc})"))
                continue
            self._remove(batch)
            self._running = bool(batch)
            try:
                if batch:
                    await self._execute(batch, loans)
            finally:
                self._running = False
                for loan in loans:  # the batch has left the device
                    loan.release()
                if loans and self.metrics is not None:
                    self.metrics.borrowed_bytes.inc(sum(loan.requested_bytes for loan in loans))

    def _fail_pending(self, error: BaseException) -> None:
        failed = list(self._pending)
        self._remove(failed)
        for generation in failed:
            generation._fail(error)

    def _choose(self, spare: int) -> tuple[list[Generation], int]:
        pending = [g for g in self._pending if not g.cancelled]
        return choose_batch(
            pending, max_batch_size=self.max_batch_size, estimator=self.estimator, spare=spare,
            capacity=self._capacity(),
        )

    def _capacity(self) -> int | None:
        device = self._device_statistics()
        return None if device is None else device.capacity_bytes

    def _device_statistics(self) -> DeviceStatistics | None:
        """This batcher's device as the ledger sees it now."""
        if self.ledger is None:
            return None
        return next((d for d in self.ledger.statistics().devices if d.name == self.loaded.device), None)

    def _remove(self, batch: list[Generation]) -> None:
        taken = set(map(id, batch))
        for generation in self._pending:
            if id(generation) not in taken:
                generation.passes += 1
        self._pending = deque(g for g in self._pending if id(g) not in taken and not g.cancelled)
        self._pending_rows = sum(len(g.sequences) for g in self._pending)
        if not self._pending:
            self._nonempty.clear()
        if self._pending_rows < self.max_batch_size:
            self._full.clear()

    def _spare_bytes(self) -> int:
        """Bytes the ledger could lend for padding right now: the device's free bytes."""
        if self.ledger is None or self.estimator is None:
            return 0
        if self.ledger.statistics().waiting >= self.ledger.max_queue:
            return 0  # a full queue would refuse even a loan
        device = self._device_statistics()
        return 0 if device is None else device.free_bytes

    async def _borrow(self, nbytes: int) -> Reservation | None:
        """Padding bytes for a batch of already-admitted requests, ahead of the queue, if they come
        free within ``BORROW_TIMEOUT`` (else None, at once when the ledger predicts a longer wait or
        refuses otherwise: the batch is formed without padding).

        They are reserved at the highest priority: admitted requests that batch together give
        their own bytes back sooner, which is what the queue is waiting for.
        """
        if self.ledger is None:
            return None
        try:
            return await self.ledger.reserve(
                nbytes, devices=(self.loaded.device,), priority=BORROW_PRIORITY, deadline=BORROW_TIMEOUT
            )
        except AdmissionRejected:
            return None

    async def _acquire(self, nbytes: int, *, keep: list[Generation]) -> Reservation | None:
        """``nbytes`` for the batch that ``keep`` is (running, or about to run), waiting for them:
        asked of the ledger ahead of the queue, and when they do not come at once, taken from the
        youngest requests queued here (not in ``keep``). None when nothing came within the
        ledger's ``max_wait``."""
        if self.ledger is None:
            return None
        ledger = self.ledger

        def ask() -> asyncio.Future[Reservation]:
            return asyncio.ensure_future(ledger.reserve(nbytes, devices=(self.loaded.device,), priority=GROWTH_PRIORITY))

        asked = ask()
        # Asked first, then taken: bytes a queued request gives up go to this loan, not to the queue.
        await asyncio.wait((asked,), timeout=BORROW_TIMEOUT)
        if not asked.done():
            self._take_from_queued(nbytes, keep)
        try:
            return await asked
        except QueueFull:
            pass  # a full queue refuses even a loan: free the bytes first, and ask again
        except AdmissionRejected:
            return None
        self._take_from_queued(nbytes, keep)
        try:
            return await ask()
        except AdmissionRejected:
            return None

    def _take_from_queued(self, nbytes: int, keep: list[Generation]) -> None:
        """Up to ``nbytes`` lent by the youngest requests queued here, those in ``keep`` aside."""
        kept = set(map(id, keep))
        taken = 0
        for generation in reversed(self._pending):
            if taken >= nbytes:
                break
            if id(generation) not in kept:
                taken += generation.lend(nbytes - taken)

    async def _grow(self, batch: list[Generation], run: RunningBatch, produced: int) -> int:
        """The steps the batch may decode now that it has ``produced``: more, once it has borrowed
        the bytes for them; ``produced`` when it could not (the batch stops there)."""
        assert self.estimator is not None
        target = min(run.limit, produced + max(GROWTH_STEP, produced // 4))
        needed = self.estimator.batch_bytes(run.prompts, [target]) - run.covered_bytes
        if needed <= 0:
            return target
        started = time.perf_counter()
        loan = await self._acquire(needed, keep=batch)
        if self.metrics is not None:
            self.metrics.growth_wait.observe(time.perf_counter() - started)
        if loan is None:
            logger.warning("a batch could not grow past %d tokens within max_wait; its answers end there", produced)
            if self.metrics is not None:
                self.metrics.growth_denied.inc()
            return produced
        run.loans.append(loan)
        run.covered_bytes += needed
        if self.metrics is not None:
            self.metrics.growth_bytes.inc(needed)
        return target

    def _grower(self, batch: list[Generation], run: RunningBatch) -> Callable[[int], int]:
        loop = asyncio.get_running_loop()
        # The ledger's reserve waits max_wait at most, and once more after a full queue refused it.
        limit = 2 * getattr(self.ledger, "max_wait", 30.0) + 5.0

        def grow(produced: int) -> int:  # on the device thread, which waits for the bytes
            future = asyncio.run_coroutine_threadsafe(self._grow(batch, run, produced), loop)
            try:
                return future.result(timeout=limit)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError, RuntimeError):
                future.cancel()
                return produced

        return grow

    async def _execute(self, batch: list[Generation], loans: list[Reservation]) -> None:
        slots: list[tuple[Generation, SequenceState]] = [(g, s) for g in batch for s in g.sequences]
        plan = BatchPlan(
            [s.prompt_ids for _, s in slots],
            [g.max_new_tokens for g, _ in slots],
            batch[0].sampling,
        )
        run = RunningBatch(plan, sum(g.held_bytes for g in batch) + sum(loan.requested_bytes for loan in loans), loans)
        if self.estimator is not None and any(g.reserved_tokens < g.max_new_tokens for g in batch):
            plan.covered = _steps_covered(self.estimator, run)
            plan.grow = self._grower(batch, run)
        offset = 0
        for generation in batch:
            generation._start(plan, offset, len(slots))
            offset += len(generation.sequences)
        self.generate_calls += 1
        self.batch_sizes.append(len(slots))
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(slots))
        loop = asyncio.get_running_loop()

        def on_step(tokens: list[int]) -> None:  # on the device thread
            loop.call_soon_threadsafe(self._on_step, slots, tokens)

        self.current = run
        links = [trace.Link(g.link) for g in batch if g.link.is_valid]
        attributes: dict[str, Any] = {"gpu_asgi.batch_size": len(slots), "demo_service.requests": len(batch)}
        try:
            with self._tracer.start_as_current_span(BATCH_SPAN, links=links, attributes=attributes):
                await self._executor.run(run_batch, self.loaded, plan, on_step)
        except asyncio.CancelledError:
            for generation in batch:
                generation._fail(RuntimeError("the service is shutting down"))
            raise
        except Exception as exc:  # whatever failed, the batch's requests are told
            for generation in batch:
                generation._fail(exc)
            return
        finally:
            self.current = None
        for generation in batch:
            generation._device_finished()
            if self.metrics is not None and generation.time_to_first_token is not None:
                self.metrics.time_to_first_token.observe(generation.time_to_first_token)

    def _on_step(self, slots: list[tuple[Generation, SequenceState]], tokens: list[int]) -> None:
        """One decoding step's tokens, one per row, on the event loop: split them per request."""
        generated = 0
        for (generation, sequence), token in zip(slots, tokens):
            if sequence.finish_reason is None:
                generated += generation._accept(sequence, token, token in self.eos_ids)
        self.tokens_generated += generated
        if self.metrics is not None and generated:
            self.metrics.generated_tokens.inc(generated)


class RunningBatch:
    """A running batch's accounts: the bytes it holds (its requests' and its loans) and the steps
    those cover."""

    __slots__ = ("covered_bytes", "limit", "loans", "prompts")

    def __init__(self, plan: BatchPlan, covered_bytes: int, loans: list[Reservation]) -> None:
        self.prompts = [len(p) for p in plan.prompts]
        self.limit = max(plan.max_new_tokens)
        self.covered_bytes = covered_bytes
        self.loans = loans


def _steps_covered(estimator: BucketedEstimator, run: RunningBatch) -> int:
    """The most decoding steps whose padded batch the bytes held cover (a binary search: bytes grow
    with steps)."""
    low, high = 0, run.limit
    while low < high:
        middle = (low + high + 1) // 2
        if estimator.batch_bytes(run.prompts, [middle]) <= run.covered_bytes:
            low = middle
        else:
            high = middle - 1
    return low
