"""One request's view of the app: ``receive``/``send`` wrapped so the app's own router decides.

The router matches first and writes the endpoint it chose into the scope (Starlette's
``Router.app`` sets ``scope["route"]`` and ``scope["endpoint"]`` before ``route.handle``); the
endpoint layer then reads the body. That first ``receive()`` is where admission happens: for a
tagged endpoint the gate reads the body, checks it and reserves its bytes (or queues for them)
right there, and the same bytes are replayed; for an untagged one the server's messages pass
untouched. A FastAPI endpoint (``@gpu_bound`` below the route decorator, see ``endpoint_call``)
is admitted when FastAPI calls it, and one that declares ``Depends(gpu_admission)`` when that
dependency runs: its body read is only checked (limits, JSON, fields) and kept, and this responder
waits in the scope for :meth:`Responder.admit`, so the app's dependencies and validation answer
first. The responder is the only part of gpu_asgi that sends: a refusal the gate raises is answered here, as problem+json.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from .._admission.gate import Admission, CheckedRequest, Gate, route_name
from .._admission.spec import RouteSpec
from .._device.policy import CLAMPED_HEADER
from .._errors import ClientClosedRequest, GPUAdmissionError
from .._timers import DelayedCall
from .._types import Message, Receive, Scope, Send
from .cancel import DisconnectWatch, cancellable, start_watch_later
from .dependencies import ADMISSION_STATE_KEY, ADMIT_SCOPE_KEY, RESERVATION_STATE_KEY, declares_admission
from .endpoint_call import admits_at_call
from .problems import ProblemStyle, send_problem
from .routes import route_spec_of

#: Scope key set when a GPUAdmissionMiddleware takes a tagged request on: as it starts admitting
#: (before it reads the body) or answers it itself. Another (nested) middleware's responder sees it
#: and steps aside, so nothing is admitted or answered twice. Never set for an untagged request,
#: whose scope is left as it came. A flag, not the responder: the responder holds the scope, and a
#: cycle would leave every request to the cyclic GC.
ADMITTING_SCOPE_KEY = "gpu_asgi.admitting"

#: Where a request stands: not routed to anything of ours yet; passed through for good; tagged,
#: waiting for its dependency to admit it; admitted; answered by gpu_asgi.
_UNDECIDED, _PASS, _DEFERRED, _ADMITTED, _ANSWERED = range(5)

logger = logging.getLogger("gpu_asgi")


class _UnreadBody(GPUAdmissionError):
    status, reason, title = 500, "route-not-admitted", "A GPU-bound route answered without being admitted"


class Answered(BaseException):
    """Raised from ``receive()`` once gpu_asgi has answered the request itself (a refusal) or the
    client left before admission: the app must stop, and the middleware swallows this.

    A ``BaseException`` so that no ``except Exception`` on the way (FastAPI's body parsing,
    Starlette's error middleware, the endpoint's own code) turns it into a 500 and a logged
    traceback, or carries on unadmitted.
    """


async def _already(admission: Admission) -> Admission:
    return admission


def caused_by_answer(error: BaseException) -> bool:
    """True for :class:`Answered`, or a group (anyio task groups) holding it.

    The other members of such a group are what our signal set off on its way out, such as a
    ``BaseHTTPMiddleware``'s "No response returned": the client already has gpu_asgi's answer.
    """
    if isinstance(error, BaseExceptionGroup):
        return any(caused_by_answer(inner) for inner in error.exceptions)
    return isinstance(error, Answered)


def matched_spec(scope: Scope) -> RouteSpec | None:
    """The spec of the endpoint the router chose for this request, if it chose a tagged one that
    no other GPUAdmissionMiddleware admits (a nested one nearer the router, whose body read
    reaches it first, or an outer one with explicit ``routes=``)."""
    spec = route_spec_of(scope.get("endpoint"), scope["method"])
    if spec is None or ADMITTING_SCOPE_KEY in scope:
        return None
    methods = getattr(scope.get("route"), "methods", None)
    if methods and scope["method"] not in methods:  # no methods (None, or empty): every method
        return None  # matched the path, not the method: the route answers 405 without reading
    return spec


class Responder:
    """Per-request state; :meth:`receive` and :meth:`send` are what the app is given.

    ``spec``: the route's spec when the host named the path in ``routes=`` (the app behind it has
    no router gpu_asgi can see); else the router's choice decides, at the first read.
    """

    __slots__ = (
        "_admission", "_body", "_cancel", "_checked", "_entry_endpoint", "_gate", "_pending", "_receive", "_scope",
        "_send", "_spec", "_state", "_style", "_watch", "_watch_start",
    )

    def __init__(
        self, gate: Gate, style: ProblemStyle, scope: Scope, receive: Receive, send: Send, spec: RouteSpec | None = None,
        *, cancel_on_disconnect: bool = True,
    ) -> None:
        self._gate = gate
        self._cancel = cancel_on_disconnect  # a route's own RouteSpec.cancel_on_disconnect wins
        self._style = style
        self._scope = scope
        self._receive = receive
        self._send = send
        self._spec = spec
        if spec is not None:
            scope[ADMITTING_SCOPE_KEY] = True  # ours, whatever router sits behind: no one else admits it
        self._state = _UNDECIDED
        #: An outer router's choice (a parent's Mount names this app): not our router's decision.
        self._entry_endpoint = scope.get("endpoint")
        self._admission: Admission | None = None
        self._body: bytes | None = None  # body bytes still to hand to the app
        self._checked: CheckedRequest | None = None  # the body the app read while admission was deferred
        #: After admission, the server's next message (only a disconnect can come) and its watch,
        #: which cancels the endpoint if the client leaves before the response starts (``cancel``).
        self._pending: asyncio.Future[Message] | None = None
        self._watch: DisconnectWatch | None = None
        #: The watch's start, due a moment after admission (``cancel.WATCH_DELAY``).
        self._watch_start: DelayedCall | None = None

    def finish(self) -> None:
        """After the app has returned or failed: release (at most once)."""
        if self._spec is not None:
            self._scope.pop(ADMIT_SCOPE_KEY, None)  # this responder: no cycle left behind
        if self._admission is not None:
            self._admission.reservation.release()
            self._gate.lifecycle.finished()
        if self._watch_start is not None:
            self._watch_start.cancel()
        if self._pending is not None:
            self._pending.cancel()

    def cancelled_on_disconnect(self, error: BaseException) -> bool:
        """Whether ``error`` is the cancellation this request's disconnect caused (then absorbed)."""
        return self._watch is not None and self._watch.absorbs(error)

    async def answer_departed(self) -> None:
        """The 499 of an endpoint cancelled because its client left, for access logs and outer middleware."""
        error = ClientClosedRequest(f"The client disconnected before {route_name(self._scope)} answered.")
        await self._refuse(error, self._spec)

    def receive(self) -> Awaitable[Message]:
        """The app's ``receive``. Whatever can be decided without waiting is decided here, so an
        untagged request gets the server's own call, with no coroutine of ours in between."""
        state = self._state
        if state == _UNDECIDED:
            spec = self._spec if self._spec is not None else matched_spec(self._scope)
            if spec is not None:
                route = self._scope.get("route")
                # A FastAPI route (it has a ``dependant``) admits at the endpoint's call or its
                # dependency; other routes at this read.
                if getattr(route, "dependant", None) is not None and (
                    admits_at_call(self._scope.get("endpoint")) or declares_admission(route)
                ):
                    self._defer(spec)
                    return self._read_deferred()
                return self._admit_and_replay(spec)
            if self._scope.get("endpoint") is not self._entry_endpoint:
                self._state = _PASS  # routed to an untagged endpoint: step aside for good
            # else not routed yet (something before the router reads the body): decide later,
            # so the check in send() still catches a tagged endpoint that runs after it
            return self._receive()
        if state == _PASS:
            return self._receive()
        if state == _DEFERRED:
            return self._read_deferred() if self._checked is None else self._receive()
        return self._receive_watched()

    def send(self, message: Message) -> Awaitable[None]:
        """The app's ``send``; the server's own call when there is nothing to add or to release."""
        state = self._state
        if state == _PASS:
            return self._send(message)
        if message["type"] == "http.response.start":
            if state == _UNDECIDED and self._spec is None and matched_spec(self._scope) is None:
                self._state = _PASS  # an untagged endpoint (or none: a 404/405) answers
                return self._send(message)
            if state == _ADMITTED and self._watch is not None:
                self._watch.response_started = True  # a stream is the server's and Starlette's to end now
                if self._watch_start is not None:  # answered before the watch was due: none needed
                    self._watch_start.cancel()
                    self._watch_start = None
            admission = self._admission
            if state == _ADMITTED and admission.clamped_from is None and admission._meter is None:  # type: ignore[union-attr]
                return self._send(message)  # the bytes are released at the last body chunk
        return self._send_watched(message)

    async def _admit_and_replay(self, spec: RouteSpec) -> Message:
        """A tagged endpoint's first read: admit, then hand it the body that admission read."""
        self._scope[ADMITTING_SCOPE_KEY] = True
        admission = await self._admit(spec)
        self._body = None
        return {"type": "http.request", "body": admission.body, "more_body": False}

    async def _admit(self, spec: RouteSpec, checked: CheckedRequest | None = None) -> Admission:
        """Admit through the gate (``checked``: the body read and checked already); a refusal is
        answered here and ends the app (:class:`Answered`)."""
        try:
            admission = await self._gate.admit(self._scope, self._receive, spec, checked)
        except GPUAdmissionError as error:
            await self._refuse(error, spec)
            raise Answered from None
        self._admission = admission
        self._body = admission.body if checked is None else None  # else the app has these bytes already
        self._state = _ADMITTED
        self._gate.lifecycle.admitted()
        cancel = self._cancel if spec.cancel_on_disconnect is None else spec.cancel_on_disconnect
        if cancel and cancellable(self._scope.get("endpoint")):
            # The whole body is read: the server's next message can only be a disconnect. It is
            # awaited from a moment after admission on, if the endpoint has not answered by then.
            self._watch = DisconnectWatch()
            self._watch_start = start_watch_later(self._start_watch)
        state = self._scope.get("state")
        if state is None:
            self._scope["state"] = state = {}
        state[ADMISSION_STATE_KEY] = admission
        state[RESERVATION_STATE_KEY] = admission.reservation
        return admission

    def _start_watch(self) -> None:
        """Keep the server's next ``receive()`` pending, for the watch."""
        self._watch_start = None
        self._pending = asyncio.ensure_future(self._receive())
        self._watch.follow(self._pending)  # type: ignore[union-attr]  # set with _watch_start

    def _defer(self, spec: RouteSpec) -> None:
        """Leave admission to the endpoint's call or dependency (:meth:`admit`): this responder goes
        in the scope for it, until :meth:`finish`."""
        scope = self._scope
        scope[ADMITTING_SCOPE_KEY] = True
        self._spec = spec
        self._state = _DEFERRED
        scope[ADMIT_SCOPE_KEY] = self

    def admit(self) -> Awaitable[Admission]:
        """The deferred admission, once: on the body the app read (checked then), or read here and
        replayed to the app when it had not read it. (The gate's own coroutine, not one around it.)"""
        if self._admission is not None:
            return _already(self._admission)
        return self._admit(self._spec, self._checked)  # type: ignore[arg-type]  # set by _defer

    async def _read_deferred(self) -> Message:
        """The app's first read before its endpoint's call or dependency admits: the whole body,
        checked (size, time, media type, JSON, the route's fields) and kept for the admission."""
        try:
            checked = await self._gate.check(self._scope, self._receive, self._spec)  # type: ignore[arg-type]
        except GPUAdmissionError as error:
            await self._refuse(error, self._spec)
            raise Answered from None
        self._checked = checked
        return {"type": "http.request", "body": checked.body, "more_body": False}

    async def _refuse(self, error: GPUAdmissionError, spec: RouteSpec | None) -> None:
        """Answer the gate's refusal; from now on the app's reads raise :class:`Answered`."""
        self._state = _ANSWERED
        # A client that left is answered too: nobody reads it, but what records the request on its
        # way out does (an access log, or an outer BaseHTTPMiddleware, whose call_next raises
        # "No response returned." for a request that got none).
        try:
            await self._style.send(self._send, error, spec, self._scope.get("path", ""))
        except OSError:  # ASGI lets a server raise on a closed connection
            if not isinstance(error, ClientClosedRequest):
                raise  # nobody is left to tell only when the client has gone

    async def _receive_watched(self) -> Message:
        """Reads after admission (or after gpu_asgi answered)."""
        if self._state == _ANSWERED:
            raise Answered
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        # A disconnect does not release here: a model call may still be using the memory in
        # a worker thread. It ends the endpoint (Starlette cancels the stream; send() raises),
        # and finish() releases once the endpoint has really stopped.
        if self._watch_start is not None:  # the app waits first: the watch shares its read
            self._watch_start.cancel()
            self._start_watch()
        pending = self._pending
        if pending is not None:  # the message the disconnect watch is waiting for
            self._pending = None
            return await pending
        return await self._receive()

    async def _send_watched(self, message: Message) -> None:
        state = self._state
        if state == _ADMITTED:
            admission: Admission = self._admission  # type: ignore[assignment]
            kind = message["type"]
            if admission.clamped_from is not None and kind == "http.response.start":
                clamp = (CLAMPED_HEADER, str(admission.max_new_tokens).encode("ascii"))
                message = {**message, "headers": [*message.get("headers", ()), clamp]}
            meter = admission._meter
            if meter is not None:  # a learned length: count what goes out, grow past the prediction
                if kind == "http.response.start":
                    meter.started(message)
                elif kind == "http.response.body":
                    meter.sent(message)  # a stream's events are counted (and grown for) before they leave
            await self._send(message)
            if (kind == "http.response.body" and not message.get("more_body", False)) or kind == "http.response.pathsend":
                admission.reservation.release()
            return
        if state in (_UNDECIDED, _DEFERRED) and message["type"] == "http.response.start":  # tagged, not admitted
            if message["status"] >= 400 or (self._spec is not None and state == _UNDECIDED):
                # Refused on its way to the endpoint, before admission: a dependency (401),
                # Starlette's per-route body limit (413), an exception handler; or, behind
                # routes=, the app answered without reading the body (its API-key check, a
                # 404, a 405). Its work did not run and nothing is reserved: the answer is theirs.
                self._state = _PASS
                await self._send(message)
                return
            self._state = _ANSWERED
            await self._answer_unread()
            raise Answered
        if state == _ANSWERED:
            return  # gpu_asgi has answered already; whatever the app sends after is dropped
        await self._send(message)

    async def _answer_unread(self) -> None:
        """A tagged endpoint started its response without being admitted: it did not read its body
        (or its body was read before the router ran, by something inside the app), or its
        ``Depends(gpu_admission)`` did not run."""
        scope = self._scope
        scope[ADMITTING_SCOPE_KEY] = True  # this answer is ours: an outer middleware passes it through
        route = route_name(scope)
        logger.error("%s is tagged @gpu_bound but answered without reading its body: it ran unadmitted", route)
        error = _UnreadBody(
            f"{route} is tagged @gpu_bound but its endpoint answered without reading the request body "
            "after routing; admission happens at that read, or in Depends(gpu_admission)/Depends(gpu_reservation)."
        )
        await send_problem(send=self._send, error=error, instance=scope.get("path", ""))
