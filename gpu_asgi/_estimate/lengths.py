"""How long answers really are, learnt online: what admission reserves instead of ``max_tokens``.

Answers end at EOS long before the limit a client declares (``max_tokens`` 1,024 or 4,096, answers
of 100-300 tokens), so reserving ``prompt + max_tokens`` holds several times the memory a request
uses. :class:`OutputLengths` keeps the lengths of the last answers of each route and tenant and
predicts a chosen quantile of them. The rule (docs/admission.md, "Learned lengths"):

- an answer cut by its own limit (``finish_reason: length``) is *censored*: it would have gone on,
  so it counts as "at least its limit": as the limit of any request it is compared with, or as
  longer (it never lowers a prediction);
- a prediction is never above the request's own limit, and never below 1 token;
- with fewer than ``min_samples`` answers seen (cold start, a new tenant or route), the prediction
  is the limit: the worst case, as strict admission reserves;
- a request's (route, tenant) lengths are used once there are enough of them, else its route's;
- both only among answers whose declared limit was in the request's band (:func:`limit_band`: 257
  to 512, 513 to 1,024, ...): a client that declares another limit often asks for another kind of
  answer, and one that runs every answer to its limit (``ignore_eos``) is learnt apart from the
  others.

:meth:`OutputLengths.survival` (pooled growth, ``GPU_ASGI_GROWTH``) counts the answers that got
as far as one running now, plus one more that goes on to its limit (few answers that far say
little), and trusts the window only while its answers end within what it predicts as often as its
quantile says: while more of the last answers ran past the prediction than chance allows (the
traffic changed), it says "goes on".

Memory is bounded: ``window`` answers per key (older ones drop out, so the model follows traffic
as it changes) and ``max_keys`` keys (the least recently seen go first).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_QUANTILE = 0.9
DEFAULT_WINDOW = 256
DEFAULT_MIN_SAMPLES = 16
DEFAULT_MAX_KEYS = 1024


def limit_band(limit: int) -> int:
    """The band of declared limits an answer is learnt with: ``b`` holds ``2**(b-1) + 1`` to
    ``2**b`` (400 is in 257-512, 4,096 in 2,049-4,096)."""
    return max(0, limit - 1).bit_length()


def _band_limits(band: int) -> tuple[int, int]:
    return (1, 1) if band == 0 else (2 ** (band - 1) + 1, 2**band)


class _Window:
    """The last ``size`` lengths, in arrival order and sorted (censored ones as ``inf``), and for
    each of the last ``checked``, whether it ran past what the window predicted when it ended."""

    __slots__ = ("arrivals", "past", "past_count", "size", "sorted")

    def __init__(self, size: int, checked: int) -> None:
        self.size = size
        self.arrivals: deque[float] = deque()
        self.sorted: list[float] = []
        self.past: deque[bool] = deque(maxlen=checked)
        self.past_count = 0

    def check(self, length: float, predicted: float) -> None:
        """Notes whether an answer of ``length`` ran past ``predicted`` (before it is added)."""
        if len(self.past) == self.past.maxlen and self.past[0]:
            self.past_count -= 1
        went_past = length > predicted
        self.past.append(went_past)
        self.past_count += went_past

    def drifting(self, quantile: float) -> bool:
        """More of the last answers ran past the prediction than a share ``1 - quantile`` of them
        would by chance (three standard deviations over)."""
        n = len(self.past)
        if 2 * n < (self.past.maxlen or 0):
            return False  # too few to tell
        miss = 1 - quantile
        return self.past_count > n * miss + 3 * math.sqrt(n * miss * quantile)

    def add(self, length: float) -> None:
        if len(self.arrivals) == self.size:
            oldest = self.arrivals.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, oldest)]
        self.arrivals.append(length)
        bisect.insort(self.sorted, length)

    def quantile(self, q: float) -> float:
        """The smallest length at least a share ``q`` of the window is at or below."""
        ordered = self.sorted
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True, slots=True)
class LengthStatistics:
    """What one key has learnt, for ``/health`` and the metrics."""

    route: str
    tenant: str | None
    #: The declared limits (lowest, highest) of the answers counted here (:func:`limit_band`).
    limits: tuple[int, int]
    samples: int
    censored: int
    #: The quantile's length in tokens; None while it is censored (an answer cut at its limit).
    predicted_tokens: int | None
    #: More of the last answers ran past the prediction than chance allows: pooled growth holds
    #: all of these answers' growth until they settle.
    drifting: bool


class OutputLengths:
    """Learned output lengths: :meth:`predict` before admission, :meth:`observe` when an answer ends.

    ``quantile`` is the risk setting: the share of answers expected to fit in what is reserved for
    them (0.9: one in ten runs past its prediction and must grow its reservation). Thread-safe:
    answers end on any thread.
    """

    def __init__(
        self,
        quantile: float = DEFAULT_QUANTILE,
        *,
        window: int = DEFAULT_WINDOW,
        min_samples: int = DEFAULT_MIN_SAMPLES,
        max_keys: int = DEFAULT_MAX_KEYS,
    ) -> None:
        if not 0 < quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {quantile!r}")
        if window < 1 or not 1 <= min_samples <= window or max_keys < 1:
            raise ValueError("need window >= 1, 1 <= min_samples <= window and max_keys >= 1")
        self.quantile = quantile
        self.window = window
        self.min_samples = min_samples
        self.max_keys = max_keys
        self._windows: OrderedDict[tuple[str, str | None, int], _Window] = OrderedDict()
        self._lock = threading.Lock()

    def predict(self, limit: int, route: str, tenant: str | None = None) -> int:
        """Tokens to reserve for an answer of at most ``limit`` tokens: the learnt quantile, at most
        ``limit``; ``limit`` itself until enough answers of this route (and tenant) with a limit in
        the same band were seen."""
        with self._lock:
            window = self._window(route, tenant, limit_band(limit))
            if window is None:
                return limit
            length = window.quantile(self.quantile)
        return limit if length >= limit else max(1, math.ceil(length))

    def survival(self, tokens: int, later: int, limit: int, route: str, tenant: str | None = None) -> float:
        """The chance that an answer of at most ``limit`` tokens which has generated ``tokens`` goes
        on past ``later`` tokens: among the answers :meth:`predict` learns from that were longer
        than ``tokens``, the share also longer than ``later``, counted as if one more had got as
        far and run to its limit, so that few answers that far say little (none: 1.0). 0.0 from
        ``limit`` on. 1.0 while the window has too few answers, or while they are drifting; a
        censored answer goes on past any."""
        if later >= limit:
            return 0.0  # its limit ends it there
        return self.survival_curve(tokens, limit, route, tenant)(later)

    def survival_curve(self, tokens: int, limit: int, route: str, tenant: str | None = None) -> Callable[[int], float]:
        """:meth:`survival` from ``tokens`` on, as a function of ``later``: the window looked up
        once, for a forecast that asks at many lengths (the answers learnt so far; ask at once)."""
        with self._lock:
            window = self._window(route, tenant, limit_band(limit))
            if window is None or window.drifting(self.quantile):
                return lambda later: 0.0 if later >= limit else 1.0
            ordered = window.sorted[:]
        count = len(ordered)
        reached = count - bisect.bisect_right(ordered, tokens) + 1  # and one more that runs to its limit

        def chance(later: int) -> float:
            if later >= limit:
                return 0.0
            return (count - bisect.bisect_right(ordered, max(tokens, later)) + 1) / reached

        return chance

    def _window(self, route: str, tenant: str | None, band: int) -> _Window | None:
        """The (route, tenant) window of the band once it has enough answers, else the route's;
        None: neither."""
        window = self._windows.get((route, tenant, band)) if tenant is not None else None
        if window is None or len(window.sorted) < self.min_samples:
            window = self._windows.get((route, None, band))
            if window is None or len(window.sorted) < self.min_samples:
                return None
        return window

    def observe(
        self, tokens: int, route: str, tenant: str | None = None, *, limit: int, truncated: bool = False
    ) -> None:
        """An answer of ``tokens`` tokens ended, its declared limit ``limit``; ``truncated`` when
        that limit cut it (it would have been longer)."""
        if tokens < 0 or limit < 1:
            raise ValueError(f"need tokens >= 0 and limit >= 1, got {tokens} and {limit}")
        length = math.inf if truncated else float(tokens)
        band = limit_band(limit)
        with self._lock:
            self._add((route, None, band), length)
            if tenant is not None:
                self._add((route, tenant, band), length)

    def _add(self, key: tuple[str, str | None, int], length: float) -> None:
        windows = self._windows
        window = windows.get(key)
        if window is None:
            window = windows[key] = _Window(self.window, checked=2 * self.min_samples)
            while len(windows) > self.max_keys:
                windows.popitem(last=False)
        else:
            windows.move_to_end(key)
        if len(window.sorted) >= self.min_samples:
            window.check(length, window.quantile(self.quantile))
        window.add(length)

    def statistics(self) -> tuple[LengthStatistics, ...]:
        """Each key's samples and prediction, most recently used last."""
        with self._lock:
            rows = []
            for (route, tenant, band), window in self._windows.items():
                samples, predicted = len(window.sorted), None
                if samples >= self.min_samples:
                    length = window.quantile(self.quantile)
                    predicted = None if math.isinf(length) else max(1, math.ceil(length))
                censored = sum(map(math.isinf, window.sorted))
                rows.append(LengthStatistics(
                    route, tenant, _band_limits(band), samples, censored, predicted, window.drifting(self.quantile)
                ))
        return tuple(rows)

    def snapshot(self) -> list[list[Any]]:
        """What has been learnt, as JSON-ready rows ``[route, tenant, band, lengths]`` (oldest key
        first, each key's lengths in arrival order, an answer cut at its limit as None): what
        :meth:`restore` takes, in this process or a new one (``LengthsFile``)."""
        with self._lock:
            return [
                [route, tenant, band, [None if math.isinf(n) else n for n in window.arrivals]]
                for (route, tenant, band), window in self._windows.items()
            ]

    def restore(self, rows: list[list[Any]]) -> int:
        """Learn the lengths of :meth:`snapshot`'s ``rows`` as if their answers had just ended (the
        last ``window`` of each key, at most ``max_keys`` keys); returns the lengths taken, counted
        per key (a tenant's answer is in its own key and its route's).
        ``ValueError`` for rows of another shape. Whether the rows fit this model is the caller's
        to decide (``LengthsFile`` checks the model and the age)."""
        parsed = []
        for row in rows:
            if not (isinstance(row, list) and len(row) == 4 and isinstance(row[0], str)
                    and (row[1] is None or isinstance(row[1], str)) and type(row[2]) is int and isinstance(row[3], list)):
                raise ValueError(f"not a learned-lengths row: {row!r:.80}")
            lengths = [math.inf if n is None else float(n) for n in row[3]]
            if any(not n >= 0 for n in lengths) or not 0 <= row[2] <= 64:
                raise ValueError(f"not a learned-lengths row: {row!r:.80}")
            parsed.append(((row[0], row[1], row[2]), lengths))
        taken = 0
        with self._lock:
            for key, lengths in parsed:
                for length in lengths[-self.window:]:
                    self._add(key, length)
                    taken += 1
        return taken

    def __repr__(self) -> str:
        return f"OutputLengths(quantile={self.quantile}, window={self.window}, min_samples={self.min_samples})"
