"""``GPUAdmissionMiddleware``: the request path of a GPU-bound route, top to bottom.

headers checked → body buffered → JSON parsed → tokens counted → bytes estimated →
bytes reserved (or queued, watching for a disconnect, or rejected) → endpoint called with the
same body bytes → reservation released exactly once, at the first of: last body chunk sent,
client disconnect, endpoint exception, cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

from ._body import check_headers, parse_request, read_body
from ._deadlines import Deadlines
from ._errors import GPUAdmissionError
from ._estimate import Estimator
from ._ledger import BudgetLedger, Reservation
from ._problems import send_problem
from ._tagging import DEFAULT_ROUTE_CACHE_SIZE, RouteResolver, RouteSpec
from ._tokens import HeuristicTokenCounter, TokenCounter, count_tokens_in_thread
from ._types import ASGIApp, Message, Receive, Scope, Send

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

    @property
    def device(self) -> str:
        return self.reservation.device


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
    ) -> None:
        if reject_status not in (429, 503):
            raise ValueError("reject_status must be 429 or 503")
        self.app = app
        self.ledger = ledger
        self.estimator = estimator
        self.token_counter: TokenCounter = token_counter or HeuristicTokenCounter()
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.reject_status = reject_status
        self._routes = RouteResolver(routes, route_cache_size)
        self._deadlines = Deadlines(tick=min(1.0, max(0.01, body_timeout / 10)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        spec = self._routes.resolve(scope)
        if spec is None:
            await self.app(scope, receive, send)
            return
        await self._admit(spec, scope, receive, send)

    async def _admit(self, spec: RouteSpec, scope: Scope, receive: Receive, send: Send) -> None:
        pending: asyncio.Future[Message] | None = None
        try:
            check_headers(scope, self.max_body_bytes)
            body = await read_body(receive, self.max_body_bytes, self.body_timeout, self._deadlines)
            if body is None:
                return  # the client left while sending: nobody to answer, nothing reserved
            request = parse_request(body, spec)
            counter = self.token_counter
            texts = [prompt.text for prompt in request.prompts]
            if sum(map(len, texts)) <= counter.inline_limit:
                counts = [counter.count(text) for text in texts]
            else:
                counts = await count_tokens_in_thread(counter, texts)
            prompt_tokens = max(n + prompt.known_tokens for n, prompt in zip(counts, request.prompts))
            batch = len(request.prompts) * request.n
            nbytes = (spec.estimator or self.estimator).estimate(prompt_tokens, request.max_new_tokens, batch)
            reservation = self.ledger.try_reserve(nbytes, devices=spec.devices)
            if reservation is None:
                reservation, pending = await self._wait(nbytes, spec, receive)
                if reservation is None:
                    return  # disconnected while queued: never admitted
        except GPUAdmissionError as error:
            status = self.reject_status if error.status == 503 else error.status
            await send_problem(send, error, status=status, instance=scope.get("path", ""))
            return

        admission = Admission(reservation, prompt_tokens, request.max_new_tokens, batch, nbytes)
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
                message = await waiting
            else:
                message = await receive()
            if message["type"] == "http.disconnect":
                reservation.release()
            return message

        async def send_releasing(message: Message) -> None:
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

    async def _wait(
        self, nbytes: int, spec: RouteSpec, receive: Receive
    ) -> tuple[Reservation | None, asyncio.Future[Message] | None]:
        """Queue for the bytes while listening for a disconnect.

        Returns the reservation and the still-pending ``receive()`` (handed on to the endpoint so
        no message is lost), or ``(None, None)`` when the client disconnected first.
        """
        reserving = asyncio.ensure_future(self.ledger.reserve(nbytes, devices=spec.devices, priority=spec.priority))
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
