"""``GPUAdmissionMiddleware``: the request path of a GPU-bound route, top to bottom.

The app's router picks the endpoint; when a tagged one first reads its body (see ``_responder``):
headers checked → body buffered → JSON parsed → tokens counted → bytes estimated → bytes reserved
(or queued, watching for a disconnect, or refused) → the same body bytes handed to that read →
reservation released exactly once, at the first of: last body chunk sent, endpoint return,
exception or cancellation (a client disconnect ends the endpoint; the bytes come back when its
work has stopped, not while a model thread may still use them).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry.trace import Span, TracerProvider

from . import _telemetry as otel
from ._body import check_headers, client_wait, parse_request, read_body
from ._deadlines import Deadlines
from ._device_policy import CLAMPED_HEADER, DeviceGuard, ThermalPolicy
from ._errors import DeadlineUnmeetable, DeviceMemoryLow, GPUAdmissionError, QueueFull, QueueTimeout
from ._estimate import Estimator, check_estimator
from ._ledger_contract import BudgetLedger, Reservation
from ._problems import send_problem
from ._responder import ADMITTING_SCOPE_KEY, Responder, caused_by_answer
from ._sampler import DeviceSampler
from ._tagging import BODYLESS_METHODS, RouteSpec, bodyless_tagged_routes
from ._tenancy import DEFAULT_TENANT
from ._tenants import TenantKey, find_tenant, named_tenants, tenant_keys, tenant_label
from ._tokens import HeuristicTokenCounter, TokenCounter, count_tokens_in_thread
from ._types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from ._metrics import GPUMetrics

_OVERLOAD = (QueueFull, QueueTimeout, DeviceMemoryLow, DeadlineUnmeetable)
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_BODY_TIMEOUT = 30.0
#: Keys under ``scope["state"]`` (so ``request.state.gpu_admission`` in Starlette/FastAPI).
ADMISSION_STATE_KEY = "gpu_admission"
RESERVATION_STATE_KEY = "gpu_reservation"
ASYNCIO_ONLY = (
    "gpu_asgi runs on asyncio only (its ledger and queue are asyncio objects): "
    "serve the app on an asyncio event loop (uvicorn, hypercorn's default asyncio worker, granian)."
)

logger = logging.getLogger("gpu_asgi")


class _UnreadBody(GPUAdmissionError):
    status, reason, title = 500, "route-not-admitted", "A GPU-bound route answered without being admitted"


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


def _route_name(scope: Scope) -> str:
    """``POST /v1/{model}/generate``: the matched route's path template, else the request path."""
    path = getattr(scope.get("route"), "path", None) or scope.get("path", "")
    return f"{scope.get('method', '')} {path}".strip()


class GPUAdmissionMiddleware:
    """Admit requests to ``@gpu_bound`` routes against a VRAM byte budget.

    ``app.add_middleware(GPUAdmissionMiddleware, ledger=Ledger(budget), estimator=...)``.
    The app's own router decides which endpoint runs; a tagged one is admitted when it first reads
    its body. Untagged routes and websockets pass straight through; lifespan too, after a check
    that the loop is asyncio and that no tagged route accepts a body-less method.
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
        tracer_provider: TracerProvider | None = None,
        metrics: GPUMetrics | None = None,
        sampler: DeviceSampler | None = None,
        thermal: ThermalPolicy | None = None,
        device_guard: DeviceGuard | None = None,
        openai_errors: bool = False,
        tenant_key: TenantKey | Sequence[TenantKey] | None = None,
        tenant_labels: Collection[str] | None = None,
    ) -> None:
        if reject_status not in (429, 503):
            raise ValueError("reject_status must be 429 or 503")
        if (thermal is not None or device_guard is not None) and sampler is None:
            raise ValueError("thermal and device_guard act on device readings: pass sampler=DeviceSampler(probe) too")
        self.app = app
        self.ledger = ledger
        check_estimator(estimator)
        self.estimator = estimator
        self.token_counter: TokenCounter = HeuristicTokenCounter() if token_counter is None else token_counter
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.reject_status = reject_status
        #: Explicit paths (a pure ASGI host without a router): this table is the host's routing.
        self._explicit = dict(routes or {})
        self._routes_checked = False
        self._deadlines = Deadlines(tick=min(1.0, max(0.01, body_timeout / 10)))
        self._tracer = otel.get_tracer(tracer_provider)
        self._queued = 0  # requests of this middleware waiting for bytes (queue depth on arrival)
        self.metrics = metrics
        self.sampler = sampler
        self.thermal = thermal
        self.device_guard = device_guard
        self.openai_errors = openai_errors  # a route's own RouteSpec.openai_errors wins
        #: Where a request's tenant is read, tried in order (a route's own RouteSpec.tenant_key wins).
        self.tenant_key = tenant_keys(tenant_key)
        #: Tenants that spans and metrics name; any other is "other".
        self._tenant_labels = named_tenants(ledger, tenant_labels)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            if not self._routes_checked:  # no lifespan ran (TestClient without `with`, lifespan off)
                self._check_routes(scope)
            # Admission reads the body, and no tagged route accepts a body-less method (checked
            # above), so GET/HEAD/OPTIONS/TRACE go straight through.
            if scope["method"] not in BODYLESS_METHODS:
                # Watched: the app gets receive/send wrapped by a Responder; the router picks the
                # endpoint, and a tagged one is admitted at its first body read. Inline, not in a
                # helper coroutine: every POST, tagged or not, would pay for that frame.
                responder = Responder(self, scope, receive, send)
                if self._explicit:
                    spec = self._explicit.get(scope["path"])
                    if (
                        spec is not None and scope["method"] in spec.methods and ADMITTING_SCOPE_KEY not in scope
                        and not await responder.admit(spec)
                    ):
                        return
                try:
                    await self.app(scope, responder.receive, responder.send)
                except BaseException as error:
                    if not caused_by_answer(error):
                        raise
                    if isinstance(error, BaseExceptionGroup):  # what else our signal set off, for whoever looks
                        logger.debug("after gpu_asgi answered %s, the app raised", _route_name(scope), exc_info=error)
                finally:
                    responder.finish()
                return
        elif kind == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse to start (``lifespan.startup.failed``) on a loop or routes gpu_asgi cannot serve."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # trio (hypercorn --worker-class trio), or another non-asyncio loop
            problem: str | None = ASYNCIO_ONLY
        else:
            try:
                self._check_routes(scope)
                problem = None
            except RuntimeError as error:
                problem = str(error)
        if problem is None:
            await self.app(scope, receive, send)
            return
        logger.error("%s", problem)
        if (await receive())["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.failed", "message": problem})

    def _check_routes(self, scope: Scope) -> None:
        """Once: a tagged route that accepts a body-less method could run unadmitted; refuse it."""
        self._routes_checked = True
        app = self.app if hasattr(self.app, "router") else scope.get("app")
        bad = bodyless_tagged_routes(app)
        if bad:
            self._routes_checked = False  # refuse every request until it is fixed
            raise RuntimeError(
                f"@gpu_bound routes must take only methods with a request body (admission reads it): "
                f"{', '.join(bad)}. Serve them with POST only."
            )

    async def admit(self, spec: RouteSpec, scope: Scope, receive: Receive, send: Send) -> Granted | None:
        """Read the body, estimate and reserve: what the endpoint gets, or None once gpu_asgi has
        answered the request itself (a refusal) or the client has left (nothing reserved)."""
        scope[ADMITTING_SCOPE_KEY] = True  # before the body read, which may pass through an outer middleware
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(ASYNCIO_ONLY) from None
        metrics = self.metrics
        if metrics is not None:
            metrics.ensure_refreshing()
        if self.sampler is not None:
            self.sampler.ensure_started()
        clamped_from: int | None = None
        try:
            raw_timeout = check_headers(scope, self.max_body_bytes)
            # Seconds this request waits in the queue at most (None: the ledger's max_wait).
            wait_limit = spec.max_client_wait
            if raw_timeout is not None:
                wait_limit = client_wait(raw_timeout, self._wait_cap if wait_limit is None else wait_limit)
            body = await read_body(receive, self.max_body_bytes, self.body_timeout, self._deadlines)
            if body is None:
                return None  # the client left while sending: nobody to answer, nothing reserved
            request = parse_request(body, spec, lambda: _route_name(scope))
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
            estimator = spec.estimator or self.estimator
            nbytes = estimator.estimate(prompt_tokens, max_new_tokens, batch, sampling=request.sampling)
            keys = self.tenant_key if spec.tenant_key is None else spec.tenant_key
            # Tenants off (no key anywhere): no work, and no tenant label on spans or metrics.
            tenant, label = DEFAULT_TENANT, None
            if keys:
                tenant = find_tenant(keys, scope, request.data)  # type: ignore[arg-type]  # a tuple since RouteSpec.__post_init__
                label = tenant_label(tenant, self._tenant_labels)
        except GPUAdmissionError as error:
            if metrics is not None:
                metrics.record_rejection(error.reason)
            await self._answer(send, scope, error, spec)
            return None
        span = self._tracer.start_span(otel.QUEUE_WAIT_SPAN)  # not made current: the endpoint's spans are siblings
        if span.is_recording():
            attributes = otel.queue_wait_attributes(
                prompt_tokens, max_new_tokens, nbytes, batch, spec.priority, clamped_from, label
            )
            span.set_attributes(attributes)
        try:
            reservation, pending = await self._reserve(span, nbytes, spec, receive, wait_limit, tenant, label)
        except GPUAdmissionError as error:
            await self._answer(send, scope, error, spec)
            return None
        if reservation is None:
            return None  # disconnected while queued: never admitted

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

    async def answer_unread(self, scope: Scope, send: Send) -> None:
        """A tagged endpoint started its response without reading its body (or its body was read
        before the router ran, by something inside the app), so it ran unadmitted."""
        scope[ADMITTING_SCOPE_KEY] = True  # this answer is ours: an outer middleware passes it through
        route = _route_name(scope)
        logger.error("%s is tagged @gpu_bound but answered without reading its body: it ran unadmitted", route)
        error = _UnreadBody(
            f"{route} is tagged @gpu_bound but its endpoint answered without reading the request body "
            "after routing; admission happens at that read (FastAPI: declare a body parameter)."
        )
        await send_problem(send, error, instance=scope.get("path", ""))

    async def _answer(self, send: Send, scope: Scope, error: GPUAdmissionError, spec: RouteSpec) -> None:
        # 429 (when configured) is for overload only; a ledger or probe outage stays a 503.
        status = self.reject_status if isinstance(error, _OVERLOAD) else error.status
        openai = self.openai_errors if spec.openai_errors is None else spec.openai_errors
        await send_problem(send, error, status=status, instance=scope.get("path", ""), openai=openai)

    @property
    def _wait_cap(self) -> float:
        """The ledger's ``max_wait`` (both ledgers have one; a ledger without it: no cap)."""
        return getattr(self.ledger, "max_wait", math.inf)

    async def _reserve(
        self,
        span: Span,
        nbytes: int,
        spec: RouteSpec,
        receive: Receive,
        wait_limit: float | None,
        tenant: str = DEFAULT_TENANT,
        label: str | None = None,
    ) -> tuple[Reservation | None, asyncio.Future[Message] | None]:
        """Reserve (or queue for) the bytes for ``tenant``, then ask the device guard, if any.

        ``label`` is the tenant as metrics name it (None: tenants are off).

        Returns what :meth:`_wait` returns, or raises the rejection. Whatever happens, the
        queue-wait span ends and the decision is counted in ``finally``.
        """
        outcome, reason, device, depth, started = otel.CANCELLED, None, None, 0, 0.0
        pending: asyncio.Future[Message] | None = None
        try:
            devices = spec.devices if self.device_guard is None else self._trusted_devices(spec, nbytes, tenant)
            reservation = self.ledger.try_reserve(nbytes, devices=devices, tenant=tenant)
            if reservation is None:
                # The deadline decision is the ledger's, at the moment it finds the request must queue.
                timeout = None if wait_limit is None else min(wait_limit, self._wait_cap)
                # Requests whose reserve() task has not run yet are not in the ledger's count: ours covers them.
                depth = max(self.ledger.statistics().waiting, self._queued)
                self._queued += 1
                started = time.perf_counter()
                reservation, pending = await self._wait(
                    nbytes, devices, spec.priority, receive, timeout, tenant, wait_limit
                )
                if reservation is None:
                    outcome = otel.DISCONNECTED
                    return None, None
                if self.device_guard is not None:  # readings may have changed while it waited
                    self._check_device(reservation, nbytes, tenant)
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
                self.metrics.record_decision(outcome, device=device, reason=reason, wait_seconds=waited, tenant=label)

    def _trusted_devices(self, spec: RouteSpec, nbytes: int, tenant: str) -> tuple[str, ...]:
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
            refusal.retry_after = self.ledger.retry_after(nbytes, tenant=tenant)
            raise refusal
        return tuple(trusted)

    def _check_device(self, reservation: Reservation, nbytes: int, tenant: str) -> None:
        """After a wait in the queue: give the bytes back and refuse when the granted device's
        sampled free memory has fallen too low meanwhile."""
        guard, sampler = self.device_guard, self.sampler
        assert guard is not None and sampler is not None
        error = guard.refusal(reservation.device, nbytes, sampler.snapshot, sampler.clock())
        if error is not None:
            reservation.release()
            error.retry_after = self.ledger.retry_after(nbytes, tenant=tenant)
            raise error

    async def _wait(
        self,
        nbytes: int,
        devices: tuple[str, ...] | None,
        priority: int,
        receive: Receive,
        timeout: float | None = None,
        tenant: str = DEFAULT_TENANT,
        wait_limit: float | None = None,
    ) -> tuple[Reservation | None, asyncio.Future[Message] | None]:
        """Queue for the bytes while listening for a disconnect (``wait_limit``: the ledger may
        refuse at once, :class:`DeadlineUnmeetable`).

        Returns the reservation and the still-pending ``receive()`` (handed on to the endpoint so
        no message is lost), or ``(None, None)`` when the client disconnected first.
        """
        reserving = asyncio.ensure_future(
            self.ledger.reserve(
                nbytes, devices=devices, priority=priority, timeout=timeout, tenant=tenant, wait_limit=wait_limit
            )
        )
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
