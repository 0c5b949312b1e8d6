"""``GPUAdmissionMiddleware``: its configuration, the ASGI entry, and the answers it gives itself.

The request path of a GPU-bound route, top to bottom, and where each step lives. The app's router
picks the endpoint; when a tagged one first reads its body (``_responder``): headers checked →
body buffered → JSON parsed → tokens counted → bytes estimated (``_admission``) → bytes reserved,
or queued, watching for a disconnect, or refused (``_queue_wait``) → the same body bytes handed to
that read → reservation released exactly once (``_responder``), at the first of: last body chunk
sent, endpoint return, exception or cancellation (a client disconnect ends the endpoint; the bytes
come back when its work has stopped, not while a model thread may still use them).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from opentelemetry.trace import TracerProvider

from .._admission import gate as _admission
from .._admission.body_timer import Deadlines
from .._admission.gate import ASYNCIO_ONLY, route_name
from .._admission.tenant_keys import TenantKey, named_tenants, tenant_keys
from .._device.policy import DeviceGuard, ThermalPolicy
from .._device.sampler import DeviceSampler
from .._errors import (
    ClientClosedRequest,
    DeadlineUnmeetable,
    DeviceMemoryLow,
    GPUAdmissionError,
    QueueFull,
    QueueTimeout,
)
from .._estimate.linear import Estimator, as_estimator
from .._estimate.tokens import HeuristicTokenCounter, TokenCounter
from .._ledger.contract import BudgetLedger
from .._ledger.legacy import as_budget_ledger
from .._observe import tracing as otel
from .._observe.lifecycle import Lifecycle
from .._types import ASGIApp, Receive, Scope, Send
from .problems import send_problem
from .responder import ADMITTING_SCOPE_KEY, Responder, caused_by_answer
from .routes import BODYLESS_METHODS, RouteSpec, bodyless_tagged_routes, declared_routes

if TYPE_CHECKING:
    from .._observe.metrics import GPUMetrics

_OVERLOAD = (QueueFull, QueueTimeout, DeviceMemoryLow, DeadlineUnmeetable)
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_BODY_TIMEOUT = 30.0

logger = logging.getLogger("gpu_asgi")


def _route_path(scope: Scope) -> str:
    """The path below the app's mount point: ASGI's ``path`` includes ``root_path`` (a ``Mount``,
    a proxy prefix), and explicit ``routes=`` name paths as the app itself sees them."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("/", ""):
        return path[len(root):] or "/"
    return path


class _UnreadBody(GPUAdmissionError):
    status, reason, title = 500, "route-not-admitted", "A GPU-bound route answered without being admitted"


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
        lifecycle: Lifecycle | None = None,
        cancel_on_disconnect: bool = True,
    ) -> None:
        if reject_status not in (429, 503):
            raise ValueError("reject_status must be 429 or 503")
        if (thermal is not None or device_guard is not None) and sampler is None:
            raise ValueError("thermal and device_guard act on device readings: pass sampler=DeviceSampler(probe) too")
        self.app = app
        self.ledger = as_budget_ledger(ledger)  # a ledger in an earlier release's shape is adapted
        self.estimator = as_estimator(estimator)
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
        self._tenant_labels = named_tenants(self.ledger, tenant_labels)
        #: Readiness and drain (``_observe.lifecycle``); without one given, ready at once.
        self.lifecycle = Lifecycle(ready=True) if lifecycle is None else lifecycle
        #: Cancel an admitted endpoint whose client leaves before its response starts (``cancel``);
        #: a route's own RouteSpec.cancel_on_disconnect wins.
        self.cancel_on_disconnect = cancel_on_disconnect

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
                    spec = self._explicit.get(_route_path(scope))
                    if (
                        spec is not None and scope["method"] in spec.methods and ADMITTING_SCOPE_KEY not in scope
                        and not await responder.admit(spec)
                    ):
                        return
                try:
                    await self.app(scope, responder.receive, responder.send)
                except BaseException as error:
                    if responder.cancelled_on_disconnect(error):  # the client left; the endpoint has stopped
                        await responder.answer_departed()
                    elif not caused_by_answer(error):
                        raise
                    if isinstance(error, BaseExceptionGroup):  # what else our signal set off, for whoever looks
                        logger.debug("after gpu_asgi answered %s, the app raised", route_name(scope), exc_info=error)
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
        # Then raise, as Starlette's own lifespan does after a failed startup: a server stops on
        # the message (and ignores the error), while Starlette's TestClient waits for the
        # lifespan to end and, without the error, would carry on as if the app had started.
        raise RuntimeError(problem)

    def _check_routes(self, scope: Scope) -> None:
        """Once: a tagged route that accepts a body-less method could run unadmitted; refuse it."""
        self._routes_checked = True
        # Our wrapped app declares the routes (through the middleware between us and its router);
        # a host whose router is not reachable that way is the app the scope names.
        app = self.app if declared_routes(self.app) is not None else scope.get("app")
        if declared_routes(app) is None and not self._explicit:
            logger.warning(
                "gpu_asgi cannot check the routes at startup: no router is reachable from %r through `.app`, "
                "so a tagged route that also takes GET is not refused. Admission still follows the router at "
                "each request; an app without a router names its GPU-bound paths with routes={...}.", self.app,
            )
        bad = bodyless_tagged_routes(app)
        if bad:
            self._routes_checked = False  # refuse every request until it is fixed
            raise RuntimeError(
                f"@gpu_bound routes must take only methods with a request body (admission reads it): "
                f"{', '.join(bad)}. Serve them with POST only."
            )

    #: ``admit(spec, scope, receive, send)``: the admission pipeline (``_admission.admit``), bound
    #: here as a method so that the responder's call into it costs no extra frame.
    admit = _admission.admit

    async def answer_unread(self, scope: Scope, send: Send) -> None:
        """A tagged endpoint started its response without reading its body (or its body was read
        before the router ran, by something inside the app), so it ran unadmitted."""
        scope[ADMITTING_SCOPE_KEY] = True  # this answer is ours: an outer middleware passes it through
        route = route_name(scope)
        logger.error("%s is tagged @gpu_bound but answered without reading its body: it ran unadmitted", route)
        error = _UnreadBody(
            f"{route} is tagged @gpu_bound but its endpoint answered without reading the request body "
            "after routing; admission happens at that read (FastAPI: declare a body parameter)."
        )
        await send_problem(send, error, instance=scope.get("path", ""))

    async def answer_departed(self, scope: Scope, send: Send, spec: RouteSpec) -> None:
        """The client left before admission. Nobody reads the answer, but what records the request
        on its way out does: an access log, or an outer ``BaseHTTPMiddleware``, whose ``call_next``
        raises "No response returned." for a request that got none."""
        error = ClientClosedRequest(f"The client disconnected before {route_name(scope)} was admitted.")
        try:
            await self._answer(send, scope, error, spec)
        except OSError:  # ASGI lets a server raise on a closed connection; nobody is left to tell
            pass

    async def _answer(self, send: Send, scope: Scope, error: GPUAdmissionError, spec: RouteSpec) -> None:
        # 429 (when configured) is for overload only; a ledger or probe outage stays a 503.
        status = self.reject_status if isinstance(error, _OVERLOAD) else error.status
        openai = self.openai_errors if spec.openai_errors is None else spec.openai_errors
        await send_problem(send, error, status=status, instance=scope.get("path", ""), openai=openai)

    @property
    def _wait_cap(self) -> float:
        """The ledger's ``max_wait``."""
        return self.ledger.max_wait
