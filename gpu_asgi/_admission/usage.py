"""What an admitted answer really uses: its tokens counted as they go out, its reservation grown
when it runs past what was reserved, and its length learnt when it ends (``OutputLengths``).

Only for requests admitted on a learned length (the middleware's ``output_lengths``). The
:class:`UsageMeter` reads OpenAI-shaped answers itself (``usage`` in a JSON body or a stream's last
event, one token per streamed event until then, ``finish_reason: length`` for an answer its limit
cut); an endpoint of another shape reports its tokens through ``Admission.report_tokens``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._estimate.contract import Estimator
from .._estimate.lengths import OutputLengths
from .._ledger.contract import Reservation
from .._types import Message

if TYPE_CHECKING:
    from .._observe.metrics import GPUMetrics

#: A JSON answer larger than this is not kept for its ``usage`` (nothing is learnt from it).
MAX_METERED_BODY = 4 << 20
_EVENT_END = b"\n\n"
_CUT = (b'"finish_reason":"length"', b'"finish_reason": "length"', b'"max_output_tokens"')
_USAGE = (b'"completion_tokens"', b'"output_tokens"')


class UsageMeter:
    """One admitted answer's tokens, per sequence; grows its reservation as they pass the tokens it
    covers, and tells ``lengths`` how long the answer was when it ends."""

    __slots__ = (
        "_batch", "_body", "_covered", "_ended", "_estimator", "_events", "_lengths", "_limit", "_metrics", "_prompt",
        "_reservation", "_route", "_status", "_stream", "_tail", "_tenant", "_truncated", "_usage", "endpoint_grows",
        "tokens",
    )

    def __init__(
        self, lengths: OutputLengths, estimator: Estimator, reservation: Reservation, *, prompt_tokens: int,
        reserved_tokens: int, limit: int, batch: int, route: str, tenant: str | None,
        metrics: GPUMetrics | None = None,
    ) -> None:
        self._lengths = lengths
        self._metrics = metrics
        self._estimator = estimator
        self._reservation = reservation
        self._prompt = prompt_tokens
        self._covered = reserved_tokens
        self._limit = limit
        self._batch = batch
        self._route = route
        self._tenant = tenant
        self._status = 0
        self._stream = False
        self._tail = b""
        self._body: bytearray | None = None
        self._events = 0
        self._usage: int | None = None
        self._truncated = False
        self._ended = False
        #: Tokens per sequence so far (the most any endpoint or stream has reported).
        self.tokens = 0
        #: The endpoint makes room for its answer itself (``Admission.endpoint_grows``): lengths are
        #: still learnt, the reservation is never grown here.
        self.endpoint_grows = False

    def survival_curve(self, tokens: int) -> Callable[[int], float]:
        """The chance this answer, at ``tokens`` per sequence, goes on past each later length (its
        route's and tenant's answers, as :meth:`OutputLengths.survival_curve` counts them)."""
        return self._lengths.survival_curve(tokens, self._limit, self._route, self._tenant)

    # -- what an endpoint reports itself --------------------------------------------------

    def report(self, tokens: int, *, done: bool = False, truncated: bool = False) -> int:
        """``tokens`` generated so far per sequence; grows the reservation once they pass what it
        covers (a step ahead, so a long answer grows a few times, not at every token). ``done``: the
        answer ended at ``tokens`` (``truncated``: cut by its limit), and is learnt. Returns the
        bytes the reservation grew by now."""
        if tokens > self.tokens:
            self.tokens = tokens
        grown = self._grow() if self.tokens > self._covered and not self.endpoint_grows else 0
        if done:
            self._truncated = self._truncated or truncated
            self._learn()
        return grown

    def _grow(self) -> int:
        step = max(16, self.tokens // 4)
        self._covered = min(self._limit, self.tokens + step)
        needed = self._estimator.estimate(self._prompt, self._covered, self._batch)
        grown = self._reservation.grow(needed)
        if self._metrics is not None:
            self._metrics.record_growth(grown)
        return grown

    def _learn(self) -> None:
        if not self._ended:
            self._ended = True
            self._lengths.observe(self.tokens, self._route, self._tenant, limit=self._limit, truncated=self._truncated)

    # -- what the responder sees going out ------------------------------------------------

    def started(self, message: Message) -> None:
        self._status = message.get("status", 200)
        for name, value in message.get("headers", ()):
            if name.lower() == b"content-type":
                self._stream = value.split(b";")[0].strip().lower() == b"text/event-stream"
        if not self._stream:
            self._body = bytearray()

    def sent(self, message: Message) -> None:
        """A body chunk went out; after the last one (``more_body`` false), the answer is learnt."""
        chunk = message.get("body", b"")
        if self._stream:
            self._count_events(chunk)
        elif self._body is not None and chunk:
            if len(self._body) + len(chunk) > MAX_METERED_BODY:
                self._body = None
            else:
                self._body += chunk
        if not message.get("more_body", False):
            self._ended_here()

    def _count_events(self, chunk: bytes) -> None:
        data = self._tail + chunk if self._tail else chunk
        *events, self._tail = data.split(_EVENT_END)
        counted = 0
        for event in events:
            if b"data:" not in event or b"[DONE]" in event:
                continue
            if any(cut in event for cut in _CUT):
                self._truncated = True
            if any(key in event for key in _USAGE):
                usage = _usage_tokens(_json(event[event.index(b"data:") + 5 :]))
                if usage is not None:
                    self._usage = usage
                    continue
            counted += 1
        if counted:
            self._events += counted
            self.report(math.ceil(self._events / self._batch))

    def _ended_here(self) -> None:
        if self._ended or self._status != 200:
            self._ended = True  # a refusal or an error: nothing to learn
            return
        if self._body is not None:
            data = _json(bytes(self._body))
            self._usage = _usage_tokens(data)
            self._truncated = self._truncated or _cut(data)
        if self._usage is not None:
            self.tokens = math.ceil(self._usage / self._batch)
        elif not self._events and not self.tokens:
            self._ended = True  # no tokens seen at all: an answer of another shape, which said nothing
            return
        self._learn()


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _usage_tokens(data: Any) -> int | None:
    """``usage.completion_tokens`` (completions, chat) or ``usage.output_tokens`` (responses)."""
    if not isinstance(data, dict):
        return None
    usage = data.get("usage")
    if not isinstance(usage, dict) and isinstance(data.get("response"), dict):  # responses' last event
        usage = data["response"].get("usage")
    if not isinstance(usage, dict):
        return None
    tokens = usage.get("completion_tokens", usage.get("output_tokens"))
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0 else None


def _cut(data: Any) -> bool:
    """Whether a JSON answer says its limit cut it."""
    if not isinstance(data, dict):
        return False
    choices = data.get("choices")
    if isinstance(choices, list):
        return any(isinstance(c, dict) and c.get("finish_reason") == "length" for c in choices)
    details = data.get("incomplete_details")
    return isinstance(details, dict) and details.get("reason") == "max_output_tokens"
