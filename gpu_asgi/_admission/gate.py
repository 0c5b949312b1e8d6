"""The gate: one request in, its :class:`Admission` out, or the :class:`GPUAdmissionError` that
refuses it. Headers checked → body read → JSON parsed → thermal clamp → tokens counted → bytes
estimated → tenant found → bytes reserved, or queued for (``queue``). The gate never sends: the
responder answers what it raises.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry.trace import Span, Tracer

from .._device.policy import DeviceGuard, ThermalPolicy
from .._device.sampler import DeviceSampler
from .._errors import ClientClosedRequest, GPUAdmissionError, QueueTimeout
from .._estimate.contract import Estimator, ObservingEstimator
from .._estimate.lengths import OutputLengths
from .._estimate.tokens import TokenCounter, count_tokens_in_thread
from .._ledger.contract import BudgetLedger, Reservation
from .._ledger.memory import Ledger
from .._ledger.tenants import DEFAULT_TENANT
from .._lifecycle import Lifecycle
from .._observe import tracing as otel
from .._observe.labels import tenant_label
from .._timers import DelayedCalls
from .._types import Receive, Scope
from .body import (
    MAX_BODY_SIZE_SCOPE_KEY,
    ParsedRequest,
    check_headers,
    client_wait,
    parse_request,
    read_body,
)
from .queue import check_device, trusted_devices, wait
from .spec import RouteSpec
from .tenant_keys import TenantKey, find_tenant
from .usage import UsageMeter

if TYPE_CHECKING:
    from .._observe.metrics import GPUMetrics

ASYNCIO_ONLY = (
    "gpu_asgi runs on asyncio only (its ledger and queue are asyncio objects): "
    "serve the app on an asyncio event loop (uvicorn, hypercorn's default asyncio worker, granian)."
)


# Not frozen, though read-only: a frozen dataclass sets each field through object.__setattr__, a
# microsecond per request for these 14. unsafe_hash keeps the hash a frozen one had.
@dataclass(slots=True, unsafe_hash=True)
class Admission:
    """What admission decided for one request; the endpoint reads it from ``request.state``
    (or ``Depends(gpu_admission)``). Treat it as read-only."""

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
    _estimator: Estimator | None = field(default=None, repr=False, compare=False)
    #: What the body asked for: True sampling, False greedy decoding, None not said.
    sampling: bool | None = None
    #: The request body admission read (and estimated from); the endpoint receives these bytes.
    body: bytes = field(default=b"", repr=False, compare=False)
    #: New tokens per sequence the reservation covers: the learned length's prediction (at most
    #: ``max_new_tokens``) when the middleware learns lengths, else None (``max_new_tokens``, strict).
    reserved_tokens: int | None = None
    _meter: UsageMeter | None = field(default=None, repr=False, compare=False)

    @property
    def device(self) -> str:
        return self.reservation.device

    @property
    def tenant(self) -> str:
        """Whom the bytes were reserved for (``"default"`` when no tenant key found one)."""
        return self.reservation.tenant

    def report_tokens(self, tokens: int, *, done: bool = False, truncated: bool = False) -> int:
        """Tell admission the new tokens generated so far per sequence; call it before decoding past
        :attr:`reserved_tokens`. The reservation grows (at once, past the budget if need be, so
        nobody new is admitted until it is back under) when ``tokens`` pass what it covers; returns
        the bytes it grew by. ``done``: the answer ended at ``tokens`` (``truncated``: its limit cut
        it), and its length is learnt. Does nothing for a request admitted strictly."""
        meter = self._meter
        return 0 if meter is None else meter.report(tokens, done=done, truncated=truncated)

    def endpoint_grows(self) -> None:
        """Say that the endpoint makes room for tokens past :attr:`reserved_tokens` itself, before it
        decodes them (with bytes it reserves from the ledger and waits for, as the demo's batcher
        does): admission then never grows this reservation, and still learns the answer's length.
        Does nothing for a request admitted strictly."""
        if self._meter is not None:
            self._meter.endpoint_grows = True

    def survival(self, tokens: int, later: int) -> float:
        """The chance that this answer, having generated ``tokens`` per sequence, goes on past
        ``later``: learnt from the answers of its route (and tenant) that got as far
        (``OutputLengths.survival``). 1.0 where nothing is known (admitted strictly, or no answer
        got that far); 0.0 from :attr:`max_new_tokens` on."""
        return self.survival_curve(tokens)(later)

    def survival_curve(self, tokens: int) -> Callable[[int], float]:
        """:meth:`survival` from ``tokens`` on, as a function of ``later`` (what it has learnt
        looked up once, for a forecast that asks at many lengths; ask at once)."""
        meter, limit = self._meter, self.max_new_tokens
        if meter is None:
            return lambda later: 0.0 if later >= limit else 1.0
        return meter.survival_curve(tokens)

    def report_peak_bytes(self, nbytes: int) -> None:
        """Report the request's measured peak bytes: to the estimate-versus-actual metric, and to
        the estimator when it learns (an ``ObservingEstimator``, as ``CalibratedEstimator`` is)."""
        if self._metrics is not None:
            self._metrics.record_peak(self.device, self.estimated_bytes, nbytes)
        estimator = self._estimator
        if isinstance(estimator, ObservingEstimator):
            estimator.observe(self.prompt_tokens, self.max_new_tokens, self.batch, nbytes, sampling=self.sampling)


@dataclass(slots=True)
class CheckedRequest:
    """A request that passed every check that needs no GPU bytes: headers, body size and time,
    JSON, the route's fields. Admission estimates and reserves from it."""

    body: bytes
    request: ParsedRequest
    #: Seconds it may wait in the queue (the route's and the client's ``x-request-timeout``;
    #: None: the ledger's ``max_wait``; ``inf``: a patient route's, never refused at arrival).
    deadline: float | None


def route_name(scope: Scope) -> str:
    """``POST /v1/{model}/generate``: the matched route's path template, else the request path."""
    path = getattr(scope.get("route"), "path", None) or scope.get("path", "")
    return f"{scope.get('method', '')} {path}".strip()


class Gate:
    """Admission for one middleware, built once from what it needs.

    :meth:`admit` per request; :meth:`check` first for a request whose admission waits for its
    endpoint's call or dependency (the app reads the body before that).
    """

    def __init__(
        self,
        *,
        ledger: BudgetLedger,
        estimator: Estimator,
        token_counter: TokenCounter,
        max_body_bytes: int,
        body_timeout: float,
        tenant_key: Sequence[TenantKey],
        tenant_labels: Collection[str],
        tracer: Tracer,
        metrics: GPUMetrics | None = None,
        sampler: DeviceSampler | None = None,
        thermal: ThermalPolicy | None = None,
        device_guard: DeviceGuard | None = None,
        lifecycle: Lifecycle | None = None,
        output_lengths: OutputLengths | None = None,
    ) -> None:
        if (thermal is not None or device_guard is not None) and sampler is None:
            raise ValueError("thermal and device_guard act on device readings: pass sampler=DeviceSampler(probe) too")
        self.ledger = ledger
        self.estimator = estimator
        self.token_counter = token_counter
        self.max_body_bytes = max_body_bytes
        #: Each body read's deadline (``body_timeout`` seconds), one timer for them all.
        self._body_deadlines = DelayedCalls(body_timeout)
        #: Where a request's tenant is read, tried in order (a route's own RouteSpec.tenant_key wins).
        self.tenant_key = tuple(tenant_key)
        #: Tenants that spans and metrics name; any other is "other".
        self.tenant_labels = tenant_labels
        self.tracer = tracer
        self.metrics = metrics
        self.sampler = sampler
        self.thermal = thermal
        self.device_guard = device_guard
        #: Readiness and drain: a draining process admits nothing new and fails its queue at once.
        self.lifecycle = Lifecycle(ready=True) if lifecycle is None else lifecycle
        #: Learned output lengths: reserve their predicted quantile, not ``max_new_tokens`` (None: strict).
        self.output_lengths = output_lengths
        #: The in-process ledger's answer needs no round trip: its ``try_reserve``, which its
        #: ``reserve_if_free`` only wraps in a coroutine (a subclass that overrides that is asked as such).
        self._reserve_at_once: Callable[..., Reservation | None] | None = (
            ledger.try_reserve if isinstance(ledger, Ledger) and type(ledger).reserve_if_free is Ledger.reserve_if_free
            else None
        )

    @property
    def body_timeout(self) -> float:
        """Seconds a request's body may take to arrive; past them, 408 ``body-timeout``."""
        return self._body_deadlines.delay

    async def admit(
        self, scope: Scope, receive: Receive, spec: RouteSpec, checked: CheckedRequest | None = None
    ) -> Admission:
        """Read and check the body from ``receive`` (or take ``checked``, from :meth:`check`),
        estimate it and reserve its bytes; ``receive`` then tells the queue when the client leaves.

        Raises the refusal (:class:`ClientClosedRequest` when the client left first); nothing is
        reserved then.
        """
        if checked is None:
            if self.lifecycle.draining:  # stopping: refused before the body is read
                self._start()
                refusal = self.lifecycle.refusal()
                self._count_refusal(refusal)
                raise refusal
            checked = await self.check(scope, receive, spec)
        try:
            request = checked.request
            max_new_tokens, clamped_from = self._clamped(request.max_new_tokens, spec)
            prompt_tokens = self._count_inline(request)
            if prompt_tokens is None:
                prompt_tokens = await self._count_in_thread(request)
            batch = len(request.prompts) * request.n
            estimator = spec.estimator or self.estimator
            keys = self.tenant_key if spec.tenant_key is None else spec.tenant_key
            # Tenants off (no key anywhere): no work, and no tenant label on spans or metrics.
            tenant, label = DEFAULT_TENANT, None
            if keys:
                tenant = find_tenant(keys, scope, request.data)  # type: ignore[arg-type]  # a tuple since RouteSpec.__post_init__
                label = tenant_label(tenant, self.tenant_labels)
            # Learned lengths: the prediction (None: strict, the limit), keyed by route and tenant.
            lengths, reserved_tokens, route, learner = self.output_lengths, None, "", None
            if lengths is not None:
                route, learner = route_name(scope), (tenant if keys else None)
                reserved_tokens = lengths.predict(max_new_tokens, route, learner)
            covered = max_new_tokens if reserved_tokens is None else reserved_tokens
            nbytes = estimator.estimate(prompt_tokens, covered, batch, sampling=request.sampling)
        except GPUAdmissionError as error:
            self._count_refusal(error)
            raise
        span = self.tracer.start_span(otel.QUEUE_WAIT_SPAN)  # not made current: the endpoint's spans are siblings
        if span.is_recording():
            span.set_attributes(otel.queue_wait_attributes(
                prompt_tokens, max_new_tokens, nbytes, batch, spec.priority, clamped_from, label
            ))
        reservation = await self._reserve(span, nbytes, spec, receive, checked.deadline, tenant, label)
        meter = None
        if lengths is not None and reserved_tokens is not None:
            meter = UsageMeter(
                lengths, estimator, reservation, prompt_tokens=prompt_tokens, reserved_tokens=reserved_tokens,
                limit=max_new_tokens, batch=batch, route=route, tenant=learner, metrics=self.metrics,
            )
            if self.metrics is not None:
                self.metrics.record_learned(reserved_tokens, max_new_tokens)
        return Admission(
            reservation, prompt_tokens, max_new_tokens, batch, nbytes, clamped_from, self.metrics, estimator,
            request.sampling, checked.body, reserved_tokens, meter,
        )

    async def check(self, scope: Scope, receive: Receive, spec: RouteSpec) -> CheckedRequest:
        """Headers checked, the body read within the size and time limits, parsed once: what an app
        may be handed before admission (what protects the server, and what FastAPI checks first,
        holds at that read), and what :meth:`admit` later reserves for."""
        self._start()
        try:
            # Everything the headers alone refuse is refused before a byte is read.
            max_bytes = self.max_body_bytes
            if MAX_BODY_SIZE_SCOPE_KEY in scope:  # a Starlette route's own limit (see body): the smaller applies
                max_bytes = min(max_bytes, scope[MAX_BODY_SIZE_SCOPE_KEY])
            raw_timeout = check_headers(scope, max_bytes)
            deadline = spec.deadline
            if raw_timeout is not None:
                deadline = client_wait(raw_timeout, self.ledger.max_wait if deadline is None else deadline)
            elif spec.patient:  # waits its deadline (cut to max_wait) whatever the prediction
                deadline = math.inf
            body = await read_body(receive, max_bytes, self._body_deadlines)
            if body is None:  # the client left before its body was whole
                raise ClientClosedRequest(f"The client disconnected before {route_name(scope)} was admitted.")
            return CheckedRequest(body, parse_request(body, spec, lambda: route_name(scope)), deadline)
        except GPUAdmissionError as error:
            self._count_refusal(error)
            raise

    def _start(self) -> None:
        """Once per request: on asyncio, with the metrics and device readings running."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(ASYNCIO_ONLY) from None
        if self.metrics is not None:
            self.metrics.ensure_refreshing()
        if self.sampler is not None:
            self.sampler.ensure_started()

    def _count_refusal(self, error: GPUAdmissionError) -> None:
        if self.metrics is not None and not isinstance(error, ClientClosedRequest):
            self.metrics.record_rejection(error.reason)

    def _clamped(self, max_new_tokens: int, spec: RouteSpec) -> tuple[int, int | None]:
        """``max_new_tokens`` under the thermal policy's limit, and the value asked for when lowered."""
        if self.thermal is None:
            return max_new_tokens, None
        limit = self.thermal.max_new_tokens_limit(self.sampler.snapshot, spec.devices)  # type: ignore[union-attr]
        if limit is None or max_new_tokens <= limit:
            return max_new_tokens, None
        if self.metrics is not None:
            self.metrics.record_clamp()
        return limit, max_new_tokens

    def _count_inline(self, request: ParsedRequest) -> int | None:
        """Prompt tokens of the longest sequence, counted here while the texts are short; None
        when they are too long to count without holding the event loop up."""
        prompts, counter = request.prompts, self.token_counter
        if len(prompts) == 1:
            prompt = prompts[0]
            return counter.count(prompt.text) + prompt.known_tokens if len(prompt.text) <= counter.inline_limit else None
        if sum(len(prompt.text) for prompt in prompts) > counter.inline_limit:
            return None
        return max(counter.count(prompt.text) + prompt.known_tokens for prompt in prompts)

    async def _count_in_thread(self, request: ParsedRequest) -> int:
        """Prompt tokens of the longest sequence, counted in a worker thread."""
        counts = await count_tokens_in_thread(self.token_counter, [prompt.text for prompt in request.prompts])
        return max(n + prompt.known_tokens for n, prompt in zip(counts, request.prompts, strict=True))

    async def _reserve(
        self, span: Span, nbytes: int, spec: RouteSpec, receive: Receive, deadline: float | None, tenant: str,
        label: str | None,
    ) -> Reservation:
        """Reserve (or queue for) the bytes, with the device guard's checks before and after.

        Whatever happens, the queue-wait span ends and the decision is counted.
        """
        outcome, reason, device, depth, started = otel.CANCELLED, None, None, 0, 0.0
        ledger, guard, sampler = self.ledger, self.device_guard, self.sampler
        try:
            if self.lifecycle.draining:  # stopping while this request's body was read
                raise self.lifecycle.refusal()
            devices = spec.devices
            if guard is not None:
                devices = trusted_devices(guard, sampler, ledger, devices, nbytes, tenant)  # type: ignore[arg-type]
            at_once = self._reserve_at_once
            if at_once is not None:
                reservation = at_once(nbytes, devices=devices, tenant=tenant)
            else:
                reservation = await ledger.reserve_if_free(nbytes, devices=devices, tenant=tenant)
            if reservation is None:
                # The deadline decision is the ledger's, at the moment it finds the request must queue.
                # The queue depth it finds: the ledger's count, or this process's own (the
                # lifecycle's, which drain needs) where the ledger's lags behind the requests
                # whose reserve() has not reached it yet.
                depth = max(ledger.statistics().waiting, self.lifecycle.waiting)
                started = time.perf_counter()
                reservation = await wait(
                    ledger, nbytes, devices=devices, priority=spec.priority, receive=receive, deadline=deadline,
                    tenant=tenant, lifecycle=self.lifecycle,
                )
                if reservation is None:
                    outcome = otel.DISCONNECTED
                    raise ClientClosedRequest("The client disconnected while its request waited for GPU memory.")
                if guard is not None:  # readings may have changed while it waited
                    check_device(guard, sampler, ledger, reservation, nbytes, tenant)  # type: ignore[arg-type]
            device = reservation.device
            outcome = otel.ADMITTED
            return reservation
        except GPUAdmissionError as error:
            if outcome != otel.DISCONNECTED:
                outcome = otel.TIMED_OUT if isinstance(error, QueueTimeout) else otel.REJECTED
                reason = error.reason
                if outcome == otel.TIMED_OUT and self.metrics is not None and "predicted_wait_seconds" in error.extensions:
                    self.metrics.record_misprediction()
            raise
        finally:
            waited = 0.0
            if started:
                waited = time.perf_counter() - started
            otel.end_queue_wait(span, outcome, device=device, queue_depth=depth, wait_seconds=waited, reason=reason)
            if self.metrics is not None:
                self.metrics.record_decision(outcome, device=device, reason=reason, wait_seconds=waited, tenant=label)
