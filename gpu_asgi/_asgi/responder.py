"""One request's view of the app: ``receive``/``send`` wrapped so the app's own router decides.

The router matches first and writes the endpoint it chose into the scope (Starlette's
``Router.app`` sets ``scope["route"]`` and ``scope["endpoint"]`` before ``route.handle``); the
endpoint layer then reads the body. That first ``receive()`` is where admission happens: for a
tagged endpoint the body is buffered, checked and its bytes reserved (or queued for) right there,
and the same bytes are replayed; for an untagged one the server's messages pass untouched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from .._ledger.contract import Reservation
from .._types import Message, Receive, Scope, Send
from .cancel import DisconnectWatch, cancellable
from .routes import RouteSpec, route_spec_of

if TYPE_CHECKING:
    from .._admission.gate import Granted
    from .middleware import GPUAdmissionMiddleware

#: Scope key set when a GPUAdmissionMiddleware takes a tagged request on: as it starts admitting
#: (before it reads the body) or answers it itself. Another (nested) middleware's responder sees it
#: and steps aside, so nothing is admitted or answered twice. Never set for an untagged request,
#: whose scope is left as it came. A flag, not the responder: the responder holds the scope, and a
#: cycle would leave every request to the cyclic GC.
ADMITTING_SCOPE_KEY = "gpu_asgi.admitting"

_UNDECIDED, _PASS, _ADMITTED, _ANSWERED = range(4)


class Answered(BaseException):
    """Raised from ``receive()`` once gpu_asgi has answered the request itself (a refusal) or the
    client left before admission: the app must stop, and the middleware swallows this.

    A ``BaseException`` so that no ``except Exception`` on the way (FastAPI's body parsing,
    Starlette's error middleware, the endpoint's own code) turns it into a 500 and a logged
    traceback, or carries on unadmitted.
    """


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
    """Per-request state; :meth:`receive` and :meth:`send` are what the app is given."""

    __slots__ = (
        "_body", "_clamp", "_entry_endpoint", "_middleware", "_pending", "_receive", "_reservation", "_scope", "_send",
        "_spec", "_state", "_watch",
    )

    def __init__(self, middleware: GPUAdmissionMiddleware, scope: Scope, receive: Receive, send: Send) -> None:
        self._middleware = middleware
        self._scope = scope
        self._receive = receive
        self._send = send
        self._state = _UNDECIDED
        #: An outer router's choice (a parent's Mount names this app): not our router's decision.
        self._entry_endpoint = scope.get("endpoint")
        self._reservation: Reservation | None = None
        self._body: bytes | None = None
        self._pending: asyncio.Future[Message] | None = None  # receive() still running from the queue wait
        self._clamp: tuple[bytes, bytes] | None = None
        self._spec: RouteSpec | None = None
        self._watch: DisconnectWatch | None = None  # cancels the endpoint if the client leaves first

    async def admit(self, spec: RouteSpec) -> bool:
        """Admit now; False when gpu_asgi answered instead (or the client left)."""
        return self._granted(spec, await self._middleware.admit(spec, self._scope, self._receive, self._send))

    def _granted(self, spec: RouteSpec, granted: Granted | None) -> bool:
        if granted is None:
            self._state = _ANSWERED
            return False
        self._reservation, self._body, self._pending, self._clamp = granted
        self._state = _ADMITTED
        self._spec = spec
        middleware = self._middleware
        middleware.lifecycle.admitted()
        cancel = middleware.cancel_on_disconnect if spec.cancel_on_disconnect is None else spec.cancel_on_disconnect
        if cancel and cancellable(self._scope.get("endpoint")):
            # The next message after the body can only be a disconnect: watch for it (``cancel``).
            if self._pending is None:
                self._pending = asyncio.ensure_future(self._receive())
            self._watch = DisconnectWatch(self._pending)
        return True

    def finish(self) -> None:
        """After the app has returned or failed: release (at most once) and stop listening."""
        if self._reservation is not None:
            self._reservation.release()
            self._middleware.lifecycle.finished()
        if self._pending is not None:
            self._pending.cancel()

    def cancelled_on_disconnect(self, error: BaseException) -> bool:
        """Whether ``error`` is the cancellation this request's disconnect caused (then absorbed)."""
        return self._watch is not None and self._watch.absorbs(error)

    async def answer_departed(self) -> None:
        """The 499 of an endpoint cancelled because its client left, for access logs and outer middleware."""
        assert self._spec is not None
        await self._middleware.answer_departed(self._scope, self._send, self._spec)

    def receive(self) -> Awaitable[Message]:
        """The app's ``receive``. Whatever can be decided without waiting is decided here, so an
        untagged request gets the server's own call, with no coroutine of ours in between."""
        state = self._state
        if state == _UNDECIDED:
            spec = matched_spec(self._scope)
            if spec is not None:
                return self._admit_and_replay(spec)
            if self._scope.get("endpoint") is not self._entry_endpoint:
                self._state = _PASS  # routed to an untagged endpoint: step aside for good
            # else not routed yet (something before the router reads the body): decide later,
            # so the check in send() still catches a tagged endpoint that runs after it
            return self._receive()
        if state == _PASS:
            return self._receive()
        return self._receive_watched()

    def send(self, message: Message) -> Awaitable[None]:
        """The app's ``send``; the server's own call when there is nothing to add or to release."""
        state = self._state
        if state == _PASS:
            return self._send(message)
        if message["type"] == "http.response.start":
            if state == _UNDECIDED and matched_spec(self._scope) is None:
                self._state = _PASS  # an untagged endpoint (or none: a 404/405) answers
                return self._send(message)
            if state == _ADMITTED and self._watch is not None:
                self._watch.response_started = True  # a stream is Starlette's to cancel from now on
            if state == _ADMITTED and self._clamp is None:
                return self._send(message)  # the bytes are released at the last body chunk
        return self._send_watched(message)

    async def _admit_and_replay(self, spec: RouteSpec) -> Message:
        """A tagged endpoint's first read: admit, then hand it the body that admission read."""
        if not self._granted(spec, await self._middleware.admit(spec, self._scope, self._receive, self._send)):
            raise Answered
        return self._replay()

    def _replay(self) -> Message:
        body, self._body = self._body, None
        return {"type": "http.request", "body": body, "more_body": False}

    async def _receive_watched(self) -> Message:
        """Reads after admission (or after gpu_asgi answered)."""
        if self._state == _ANSWERED:
            raise Answered
        if self._body is not None:
            return self._replay()
        if self._pending is not None:
            waiting, self._pending = self._pending, None
            return await waiting
        # A disconnect does not release here: a model call may still be using the memory in
        # a worker thread. It ends the endpoint (Starlette cancels the stream; send() raises),
        # and finish() releases once the endpoint has really stopped.
        return await self._receive()

    async def _send_watched(self, message: Message) -> None:
        state = self._state
        if state == _ADMITTED:
            kind = message["type"]
            if self._clamp is not None and kind == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self._clamp]}
            await self._send(message)
            if (kind == "http.response.body" and not message.get("more_body", False)) or kind == "http.response.pathsend":
                self._reservation.release()  # type: ignore[union-attr]
            return
        if state == _UNDECIDED and message["type"] == "http.response.start":  # a tagged endpoint, body unread
            if message["status"] >= 400:
                # Refused on its way to the endpoint, before the body read: a dependency (401),
                # Starlette's per-route body limit (413), an exception handler. The endpoint's work
                # did not run and nothing is reserved: the answer is theirs, untouched.
                self._state = _PASS
                await self._send(message)
                return
            self._state = _ANSWERED
            await self._middleware.answer_unread(self._scope, self._send)
            raise Answered
        if state == _ANSWERED:
            return  # gpu_asgi has answered already; whatever the app sends after is dropped
        await self._send(message)
