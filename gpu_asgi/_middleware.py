"""``GPUAdmissionMiddleware``: the request path of a GPU-bound route, top to bottom.

headers checked → body buffered → JSON parsed → tokens counted → bytes estimated →
bytes reserved (or queued, watching for a disconnect, or rejected) → endpoint called with the
same body bytes → reservation released exactly once, at the first of: last body chunk sent,
endpoint return, exception or cancellation (a client disconnect ends the endpoint; the bytes come
back when its work has stopped, not while a model thread may still use them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry.trace import Span, TracerProvider

from . import _telemetry as otel
from ._body import check_headers, parse_request, read_body
from ._deadlines import Deadlines
from ._device_policy import CLAMPED_HEADER, DeviceGuard, ThermalPolicy
from ._errors import DeviceMemoryLow, GPUAdmissionError, QueueFull, QueueTimeout
from ._estimate import Estimator
from ._ledger import BudgetLedger, Reservation
from ._problems import send_problem
from ._sampler import DeviceSampler
from ._tagging import DEFAULT_ROUTE_CACHE_SIZE, RouteResolver, RouteSpec
from ._tokens import HeuristicTokenCounter, TokenCounter, count_tokens_in_thread
from ._types import ASGIApp, Message, Receive, Scope, Send, mark_coroutine_function

if TYPE_CHECKING:
    from ._metrics import GPUMetrics

_OVERLOAD = (QueueFull, QueueTimeout, DeviceMemoryLow)
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_BODY_TIMEOUT = 30.0
#: Keys under ``scope["state"]`` (so ``request.state.gpu_admission`` in Starlette/FastAPI).
ADMISSION_STATE_KEY = "gpu_admission"
RESERVATION_STATE_KEY = "gpu_reservation"


@dataclass(slots=True)  # not frozen: a frozen __init__ costs a microsecond on the hot path
class Admission:
    """What the middleware decided for this request; the endpoint reads it from ``request.state``."""

    reservation: Reservation
    prompt_tokens: int
    max_new_tokens: int
    #: Sequences generated: prompts in the body × ``n``.
    batch: int
    estimated_bytes: int
    #: ``max_new_tokens`` as the client asked, when the thermal policy lowered it (else None).
    #: The body still holds the client's value: generate with :attr:`max_new_tokens`.
    clamped_from: int | None = None
    _metrics: GPUMetrics | None = field(default=None, repr=False, compare=False)

    @property
    def device(self) -> str:
        return self.reservation.device

    def report_peak_bytes(self, nbytes: int) -> None:
        """Report the request's measured peak bytes (feeds the estimate-versus-actual metric)."""
        if self._metrics is not None:
            self._metrics.record_peak(self.device, self.estimated_bytes, nbytes)


class GPUAdmissionMiddleware:
    """Admit requests to ``@gpu_bound`` routes against a VRAM byte budget.

    ``app.add_middleware(GPUAdmissionMiddleware, ledger=Ledger(budget), estimator=...)``.
    Untagged routes, websockets and lifespan pass straight through.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        ledger: BudgetLedger,
        estimator: Estimator,
        token_counter: TokenCounter | None = None,
        routes: Mapping[str, RouteSpec] | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        reject_status: int = 503,
        route_cache_size: int = DEFAULT_ROUTE_CACHE_SIZE,
        tracer_provider: TracerProvider | None = None,
        metrics: GPUMetrics | None = None,
        sampler: DeviceSampler | None = None,
        thermal: ThermalPolicy | None = None,
        device_guard: DeviceGuard | None = None,
    ) -> None:
        if reject_status not in (429, 503):
            raise ValueError("reject_status must be 429 or 503")
        if (thermal is not None or device_guard is not None) and sampler is None:
            raise ValueError("thermal and device_guard act on device readings: pass sampler=DeviceSampler(probe) too")
        self.app = app
        self.ledger = ledger
        self.estimator = estimator
        self.token_counter: TokenCounter = HeuristicTokenCounter() if token_counter is None else token_counter
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.reject_status = reject_status
        self._routes = RouteResolver(routes, route_cache_size, wrapped=app)
        self._route_cache = self._routes.cache
        self._deadlines = Deadlines(tick=min(1.0, max(0.01, body_timeout / 10)))
        self._tracer = otel.get_tracer(tracer_provider)
        self._queued = 0  # requests of this middleware waiting for bytes (queue depth on arrival)
        self.metrics = metrics
        self.sampler = sampler
        self.thermal = thermal
        self.device_guard = device_guard

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        # A plain function handing back the next coroutine: one frame fewer per request than an
        # ``async def`` awaiting it (marked below so servers still see an ASGI 3 app).
        try:  # the resolver's cache, read inline: this is all an untagged HTTP request pays
            spec = self._route_cache[scope["path"]][scope["method"]]
        except KeyError:  # not cached yet, or not HTTP (lifespan has no path, websockets no method)
            spec = self._routes.resolve(scope) if scope["type"] == "http" else None
        if spec is None or scope["type"] != "http":
            return self.app(scope, receive, send)
        return self._admit(spec, scope, receive, send)

    mark_coroutine_function(__call__)

    async def _admit(self, spec: RouteSpec, scope: Scope, receive: Receive, send: Send) -> None:
        metrics = self.metrics
        if metrics is not None:
            metrics.ensure_refreshing()
        if self.sampler is not None:
            self.sampler.ensure_started()
        clamped_from: int | None = None
        try:
            check_headers(scope, self.max_body_bytes)
            body = await read_body(receive, self.max_body_bytes, self.body_timeout, self._deadlines)
            if body is None:
                return  # the client left while sending: nobody to answer, nothing reserved
            request = parse_request(body, spec)
            max_new_tokens = request.max_new_tokens
            thermal = self.thermal
            if thermal is not None:  # before estimating: the estimate is for the clamped value
                limit = thermal.max_new_tokens_limit(self.sampler.snapshot, spec.devices)  # type: ignore[union-attr]
                if limit is not None and max_new_tokens > limit:
                    clamped_from, max_new_tokens = max_new_tokens, limit
                    if metrics is not None:
                        metrics.record_clamp()
            prompts, counter = request.prompts, self.token_counter
            if len(prompts) == 1 and len(prompts[0].text) <= counter.inline_limit:  # the common case, inline
                prompt_tokens = counter.count(prompts[0].text) + prompts[0].known_tokens
            else:
                texts = [prompt.text for prompt in prompts]
                if sum(map(len, texts)) <= counter.inline_limit:
                    counts = [counter.count(text) for text in texts]
                else:
                    counts = await count_tokens_in_thread(counter, texts)
                prompt_tokens = max(n + prompt.known_tokens for n, prompt in zip(counts, prompts))
            batch = len(prompts) * request.n
            nbytes = (spec.estimator or self.estimator).estimate(prompt_tokens, max_new_tokens, batch)
        except GPUAdmissionError as error:
            if metrics is not None:
                metrics.record_rejection(error.reason)
            await self._answer(send, scope, error)
            return
        span = self._tracer.start_span(otel.QUEUE_WAIT_SPAN)  # not made current: the endpoint's spans are siblings
        if span.is_recording():
            attributes = otel.queue_wait_attributes(
                prompt_tokens, max_new_tokens, nbytes, batch, spec.priority, clamped_from
            )
            span.set_attributes(attributes)
        try:
            reservation, pending = await self._reserve(span, nbytes, spec, receive)
        except GPUAdmissionError as error:
            await self._answer(send, scope, error)
            return
        if reservation is None:
            return  # disconnected while queued: never admitted

        admission = Admission(reservation, prompt_tokens, max_new_tokens, batch, nbytes, clamped_from, metrics)
        state = scope.get("state")
        if state is None:
            scope["state"] = state = {}
        state[ADMISSION_STATE_KEY] = admission
        state[RESERVATION_STATE_KEY] = reservation
        replayed = False

        async def receive_replay() -> Message:
            nonlocal replayed, pending
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            if pending is not None:
                waiting, pending = pending, None
                return await waiting
            # A disconnect does not release here: a model call may still be using the memory in
            # a worker thread. It ends the endpoint (Starlette cancels the stream; send() raises),
            # and the ``finally`` below releases once the endpoint has really stopped.
            return await receive()

        clamp_header = None if clamped_from is None else (CLAMPED_HEADER, str(max_new_tokens).encode("ascii"))

        async def send_releasing(message: Message) -> None:
            if clamp_header is not None and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), clamp_header]}
            await send(message)
            kind = message["type"]
            if (kind == "http.response.body" and not message.get("more_body", False)) or kind == "http.response.pathsend":
                reservation.release()

        try:
            await self.app(scope, receive_replay, send_releasing)
        finally:
            reservation.release()
            if pending is not None:
                pending.cancel()

    async def _answer(self, send: Send, scope: Scope, error: GPUAdmissionError) -> None:
        # 429 (when configured) is for overload only; a ledger or probe outage stays a 503.
        status = self.reject_status if isinstance(error, _OVERLOAD) else error.status
        await send_problem(send, error, status=status, instance=scope.get("path", ""))

    async def _reserve(
        self, span: Span, nbytes: int, spec: RouteSpec, receive: Receive
    ) -> tuple[Reservation | None, asyncio.Future[Message] | None]:
        """Reserve (or queue for) the bytes, then ask the device guard, if any.

        Returns what :meth:`_wait` returns, or raises the rejection. Whatever happens, the
        queue-wait span ends and the decision is counted in ``finally``.
        """
        outcome, reason, device, depth, started = otel.CANCELLED, None, None, 0, 0.0
        pending: asyncio.Future[Message] | None = None
        try:
            devices = spec.devices if self.device_guard is None else self._trusted_devices(spec, nbytes)
            reservation = self.ledger.try_reserve(nbytes, devices=devices)
            if reservation is None:
                # Requests whose reserve() task has not run yet are not in the ledger's count: ours covers them.
                depth = max(self.ledger.statistics().waiting, self._queued)
                self._queued += 1
                started = time.perf_counter()
                reservation, pending = await self._wait(nbytes, devices, spec.priority, receive)
                if reservation is None:
                    outcome = otel.DISCONNECTED
                    return None, None
                if self.device_guard is not None:  # readings may have changed while it waited
                    self._check_device(reservation, nbytes)
            device = reservation.device
            outcome = otel.ADMITTED
            return reservation, pending
        except GPUAdmissionError as error:
            outcome = otel.TIMED_OUT if isinstance(error, QueueTimeout) else otel.REJECTED
            reason = error.reason
            if pending is not None:
                pending.cancel()
            raise
        finally:
            waited = 0.0
            if started:
                self._queued -= 1
                waited = time.perf_counter() - started
            otel.end_queue_wait(span, outcome, device=device, queue_depth=depth, wait_seconds=waited, reason=reason)
            if self.metrics is not None:
                self.metrics.record_decision(outcome, device=device, reason=reason, wait_seconds=waited)

    def _trusted_devices(self, spec: RouteSpec, nbytes: int) -> tuple[str, ...]:
        """Trust the device: the route's devices whose sampled free memory can take ``nbytes``.

        The ledger then places the request only on those, so a device that another process has
        filled is passed over rather than refused. With none left, the first refusal is raised.
        """
        guard, sampler = self.device_guard, self.sampler
        assert guard is not None and sampler is not None
        snapshot, now = sampler.snapshot, sampler.clock()
        trusted, refusal = [], None
        for device in spec.devices or self.ledger.devices:
            error = guard.refusal(device, nbytes, snapshot, now)
            if error is None:
                trusted.append(device)
            elif refusal is None:
                refusal = error
        # None trusted, or only a guarded-off device could hold the bytes: a shortage for now (503
        # with Retry-After), never the ledger's "waiting cannot help" (413) about the rest.
        every = spec.devices or self.ledger.devices
        if refusal is not None and (not trusted or _largest(self.ledger, trusted) < nbytes <= _largest(self.ledger, every)):
            refusal.retry_after = self.ledger.retry_after(nbytes)
            raise refusal
        return tuple(trusted)

    def _check_device(self, reservation: Reservation, nbytes: int) -> None:
        """After a wait in the queue: give the bytes back and refuse when the granted device's
        sampled free memory has fallen too low meanwhile."""
        guard, sampler = self.device_guard, self.sampler
        assert guard is not None and sampler is not None
        error = guard.refusal(reservation.device, nbytes, sampler.snapshot, sampler.clock())
        if error is not None:
            reservation.release()
            error.retry_after = self.ledger.retry_after(nbytes)
            raise error

    async def _wait(
        self, nbytes: int, devices: tuple[str, ...] | None, priority: int, receive: Receive
    ) -> tuple[Reservation | None, asyncio.Future[Message] | None]:
        """Queue for the bytes while listening for a disconnect.

        Returns the reservation and the still-pending ``receive()`` (handed on to the endpoint so
        no message is lost), or ``(None, None)`` when the client disconnected first.
        """
        reserving = asyncio.ensure_future(self.ledger.reserve(nbytes, devices=devices, priority=priority))
        listening: asyncio.Future[Message] = asyncio.ensure_future(receive())
        try:
            while True:
                await asyncio.wait((reserving, listening), return_when=asyncio.FIRST_COMPLETED)
                if reserving.done():
                    return reserving.result(), listening  # raises the ledger's rejection, if any
                if listening.result()["type"] == "http.disconnect":
                    reserving.cancel()
                    outcome = (await asyncio.gather(reserving, return_exceptions=True))[0]
                    if isinstance(outcome, Reservation):
                        outcome.release()  # granted in the same instant: give it straight back
                    return None, None
                listening = asyncio.ensure_future(receive())  # not a disconnect: keep listening
        except BaseException:
            listening.cancel()
            if not reserving.done():
                reserving.cancel()
            elif not reserving.cancelled() and isinstance(granted := reserving.exception() or reserving.result(), Reservation):
                granted.release()  # we were cancelled just as the bytes were granted
            raise


def _largest(ledger: BudgetLedger, devices: Sequence[str]) -> int:
    """The largest budget among ``devices``."""
    return max(d.capacity_bytes for d in ledger.statistics().devices if d.name in devices)
