"""The admission pipeline and the record it produces: headers checked → body buffered → JSON parsed
→ thermal clamp → tokens counted → bytes estimated → tenant found → bytes reserved (``_queue_wait``).

:func:`admit` is bound as ``GPUAdmissionMiddleware.admit``: it reads the middleware's
configuration, and being a method rather than a call from one costs the request no extra frame.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._asgi.responder import ADMITTING_SCOPE_KEY
from .._asgi.routes import RouteSpec
from .._device.policy import CLAMPED_HEADER
from .._errors import GPUAdmissionError, ShuttingDown
from .._estimate.linear import Estimator
from .._estimate.tokens import count_tokens_in_thread
from .._ledger.contract import Reservation
from .._ledger.tenants import DEFAULT_TENANT
from .._observe import tracing as otel
from .._types import Message, Receive, Scope, Send
from .body import MAX_BODY_SIZE_SCOPE_KEY, check_headers, client_wait, parse_request, read_body
from .queue_wait import reserve
from .tenant_keys import find_tenant, tenant_label

if TYPE_CHECKING:
    from .._asgi.middleware import GPUAdmissionMiddleware
    from .._observe.metrics import GPUMetrics

#: Keys under ``scope["state"]`` (so ``request.state.gpu_admission`` in Starlette/FastAPI).
ADMISSION_STATE_KEY = "gpu_admission"
RESERVATION_STATE_KEY = "gpu_reservation"
ASYNCIO_ONLY = (
    "gpu_asgi runs on asyncio only (its ledger and queue are asyncio objects): "
    "serve the app on an asyncio event loop (uvicorn, hypercorn's default asyncio worker, granian)."
)

#: What admission hands the responder: the reservation, the body to replay, the receive() still
#: pending from the queue wait, and the thermal clamp header (if any).
Granted = tuple[Reservation, bytes, "asyncio.Future[Message] | None", "tuple[bytes, bytes] | None"]


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
    _estimator: Estimator | None = field(default=None, repr=False, compare=False)
    #: What the body asked for: True sampling, False greedy decoding, None not said.
    sampling: bool | None = None

    @property
    def device(self) -> str:
        return self.reservation.device

    @property
    def tenant(self) -> str:
        """Whom the bytes were reserved for (``"default"`` when no tenant key found one)."""
        return self.reservation.tenant

    def report_peak_bytes(self, nbytes: int) -> None:
        """Report the request's measured peak bytes: to the estimate-versus-actual metric, and to
        the estimator when it learns (an ``observe`` method, as ``CalibratedEstimator`` has)."""
        if self._metrics is not None:
            self._metrics.record_peak(self.device, self.estimated_bytes, nbytes)
        observe = getattr(self._estimator, "observe", None)
        if observe is not None:
            observe(self.prompt_tokens, self.max_new_tokens, self.batch, nbytes, sampling=self.sampling)


def route_name(scope: Scope) -> str:
    """``POST /v1/{model}/generate``: the matched route's path template, else the request path."""
    path = getattr(scope.get("route"), "path", None) or scope.get("path", "")
    return f"{scope.get('method', '')} {path}".strip()


async def admit(
    middleware: GPUAdmissionMiddleware, spec: RouteSpec, scope: Scope, receive: Receive, send: Send
) -> Granted | None:
    """Read the body, estimate and reserve: what the endpoint gets, or None once gpu_asgi has
    answered the request itself (a refusal, or the 499 of a client that left; nothing reserved)."""
    scope[ADMITTING_SCOPE_KEY] = True  # before the body read, which may pass through an outer middleware
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(ASYNCIO_ONLY) from None
    metrics = middleware.metrics
    if metrics is not None:
        metrics.ensure_refreshing()
    if middleware.lifecycle.draining:  # stopping: refused before the body is read (_observe.lifecycle)
        if metrics is not None:
            metrics.record_rejection(ShuttingDown.reason)
        await middleware._answer(send, scope, middleware.lifecycle.refusal(), spec)
        return None
    if middleware.sampler is not None:
        middleware.sampler.ensure_started()
    clamped_from: int | None = None
    try:
        max_bytes = middleware.max_body_bytes
        if MAX_BODY_SIZE_SCOPE_KEY in scope:  # a Starlette route's own limit (see _body): the smaller applies
            max_bytes = min(max_bytes, scope[MAX_BODY_SIZE_SCOPE_KEY])
        raw_timeout = check_headers(scope, max_bytes)
        # Seconds this request waits in the queue at most (None: the ledger's max_wait).
        wait_limit = spec.max_client_wait
        if raw_timeout is not None:
            wait_limit = client_wait(raw_timeout, middleware._wait_cap if wait_limit is None else wait_limit)
        body = await read_body(receive, max_bytes, middleware.body_timeout, middleware._deadlines)
        if body is None:  # the client left while sending: nothing reserved
            await middleware.answer_departed(scope, send, spec)
            return None
        request = parse_request(body, spec, lambda: route_name(scope))
        max_new_tokens = request.max_new_tokens
        thermal = middleware.thermal
        if thermal is not None:  # before estimating: the estimate is for the clamped value
            limit = thermal.max_new_tokens_limit(middleware.sampler.snapshot, spec.devices)  # type: ignore[union-attr]
            if limit is not None and max_new_tokens > limit:
                clamped_from, max_new_tokens = max_new_tokens, limit
                if metrics is not None:
                    metrics.record_clamp()
        prompts, counter = request.prompts, middleware.token_counter
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
        estimator = spec.estimator or middleware.estimator
        nbytes = estimator.estimate(prompt_tokens, max_new_tokens, batch, sampling=request.sampling)
        keys = middleware.tenant_key if spec.tenant_key is None else spec.tenant_key
        # Tenants off (no key anywhere): no work, and no tenant label on spans or metrics.
        tenant, label = DEFAULT_TENANT, None
        if keys:
            tenant = find_tenant(keys, scope, request.data)  # type: ignore[arg-type]  # a tuple since RouteSpec.__post_init__
            label = tenant_label(tenant, middleware._tenant_labels)
    except GPUAdmissionError as error:
        if metrics is not None:
            metrics.record_rejection(error.reason)
        await middleware._answer(send, scope, error, spec)
        return None
    span = middleware._tracer.start_span(otel.QUEUE_WAIT_SPAN)  # not made current: the endpoint's spans are siblings
    if span.is_recording():
        attributes = otel.queue_wait_attributes(
            prompt_tokens, max_new_tokens, nbytes, batch, spec.priority, clamped_from, label
        )
        span.set_attributes(attributes)
    try:
        reservation, pending = await reserve(middleware, span, nbytes, spec, receive, wait_limit, tenant, label)
    except GPUAdmissionError as error:
        await middleware._answer(send, scope, error, spec)
        return None
    if reservation is None:  # disconnected while queued: never admitted
        await middleware.answer_departed(scope, send, spec)
        return None

    admission = Admission(
        reservation, prompt_tokens, max_new_tokens, batch, nbytes, clamped_from, metrics, estimator, request.sampling
    )
    state = scope.get("state")
    if state is None:
        scope["state"] = state = {}
    state[ADMISSION_STATE_KEY] = admission
    state[RESERVATION_STATE_KEY] = reservation
    clamp_header = None if clamped_from is None else (CLAMPED_HEADER, str(max_new_tokens).encode("ascii"))
    return reservation, body, pending, clamp_header
