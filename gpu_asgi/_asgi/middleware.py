"""``GPUAdmissionMiddleware``: its configuration, the ASGI entry, and the startup checks.

The request path of a GPU-bound route, top to bottom, and where each step lives. The app's router
picks the endpoint; when a tagged one first reads its body (``responder``), the gate
(``_admission.gate``) checks the headers, reads and parses the body, counts tokens, estimates bytes
and reserves them, or queues for them watching for a disconnect (``_admission.queue``), or raises
the refusal, which the responder answers → the same body bytes handed to that read → reservation
released exactly once (``responder``), at the first of: last body chunk sent, endpoint return,
exception or cancellation (a client disconnect ends the endpoint; the bytes come back when its
work has stopped, not while a model thread may still use them).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from opentelemetry.trace import TracerProvider

from .._admission.gate import ASYNCIO_ONLY, Gate, route_name
from .._admission.spec import BODYLESS_METHODS, RouteSpec
from .._admission.tenant_keys import TenantKey, tenant_keys
from .._device.policy import DeviceGuard, ThermalPolicy
from .._device.sampler import DeviceSampler
from .._estimate.contract import Estimator, as_estimator
from .._estimate.lengths import OutputLengths
from .._estimate.tokens import HeuristicTokenCounter, TokenCounter
from .._ledger.contract import BudgetLedger
from .._ledger.legacy import as_budget_ledger
from .._lifecycle import Lifecycle
from .._observe import tracing as otel
from .._observe.labels import named_tenants
from .._types import ASGIApp, Receive, Scope, Send
from .problems import ProblemStyle
from .responder import ADMITTING_SCOPE_KEY, Responder, caused_by_answer
from .routes import bodyless_tagged_routes, declared_routes, early_admitted_routes

if TYPE_CHECKING:
    from .._observe.metrics import GPUMetrics

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
        output_lengths: OutputLengths | None = None,
    ) -> None:
        self.app = app
        self.ledger = as_budget_ledger(ledger)  # a ledger in an earlier release's shape is adapted
        self.estimator = as_estimator(estimator)  # an estimator that takes no sampling= is wrapped
        self.token_counter: TokenCounter = HeuristicTokenCounter() if token_counter is None else token_counter
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.reject_status = reject_status
        self.metrics = metrics
        self.sampler = sampler
        self.thermal = thermal
        self.device_guard = device_guard
        self.openai_errors = openai_errors  # a route's own RouteSpec.openai_errors wins
        #: Where a request's tenant is read, tried in order (a route's own RouteSpec.tenant_key wins).
        self.tenant_key = tenant_keys(tenant_key)
        #: Readiness and drain (``_lifecycle``); without one given, ready at once.
        self.lifecycle = Lifecycle(ready=True) if lifecycle is None else lifecycle
        #: Cancel an admitted endpoint whose client leaves before its response starts (``cancel``);
        #: a route's own RouteSpec.cancel_on_disconnect wins.
        self.cancel_on_disconnect = cancel_on_disconnect
        self._style = ProblemStyle(reject_status, openai_errors)
        #: Learned output lengths (``OutputLengths``): reserve a quantile of what answers of a route
        #: really used, and grow a reservation whose answer runs past it. None (the default): strict,
        #: ``prompt + max_new_tokens``. An endpoint that allocates as it generates must report its
        #: tokens first (``Admission.report_tokens``): docs/admission.md, "Learned lengths".
        self.output_lengths = output_lengths
        if output_lengths is not None and getattr(self.ledger, "grow", None) is None:
            raise ValueError("output_lengths needs a ledger whose reservations can grow (BudgetLedger.grow)")
        self._gate = Gate(
            ledger=self.ledger, estimator=self.estimator, token_counter=self.token_counter,
            max_body_bytes=max_body_bytes, body_timeout=body_timeout, tenant_key=self.tenant_key,
            tenant_labels=named_tenants(self.ledger, tenant_labels), tracer=otel.get_tracer(tracer_provider),
            metrics=metrics, sampler=sampler, thermal=thermal, device_guard=device_guard, lifecycle=self.lifecycle,
            output_lengths=output_lengths,
        )
        #: Explicit paths (a pure ASGI host without a router): this table is the host's routing.
        self._explicit = dict(routes or {})
        self._routes_checked = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            if not self._routes_checked:  # no lifespan ran (TestClient without `with`, lifespan off)
                self._check_routes(scope)
            # Admission reads the body, and no tagged route accepts a body-less method (checked
            # above), so GET/HEAD/OPTIONS/TRACE go straight through.
            if scope["method"] not in BODYLESS_METHODS:
                # Watched: the app gets receive/send wrapped by a Responder; the router picks the
                # endpoint, and a tagged one is admitted at its first body read (FastAPI's: when
                # FastAPI calls it, after its dependencies).
                # A path named in routes= is admitted at the app's first body read, like a tagged
                # endpoint: what the app answers before reading (its auth, a 404, a 405) passes.
                spec = self._explicit.get(_route_path(scope)) if self._explicit else None
                if spec is not None and (scope["method"] not in spec.methods or ADMITTING_SCOPE_KEY in scope):
                    spec = None
                responder = Responder(
                    self._gate, self._style, scope, receive, send, spec, cancel_on_disconnect=self.cancel_on_disconnect
                )
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
        early = early_admitted_routes(app)
        if early:
            logger.warning(
                "@gpu_bound sits above the route decorator on %s: FastAPI registered the bare function, so these "
                "routes are admitted at their body read, before their dependencies (auth) run. Put @gpu_bound() "
                "below @app.post(...) (docs/endpoints.md).", ", ".join(early),
            )
        bad = bodyless_tagged_routes(app)
        if bad:
            self._routes_checked = False  # refuse every request until it is fixed
            raise RuntimeError(
                f"@gpu_bound routes must take only methods with a request body (admission reads it): "
                f"{', '.join(bad)}. Serve them with POST only."
            )
