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
- a request's (route, tenant) lengths are used once there are enough of them, else its route's.

Memory is bounded: ``window`` answers per key (older ones drop out, so the model follows traffic
as it changes) and ``max_keys`` keys (the least recently seen go first).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

DEFAULT_QUANTILE = 0.9
DEFAULT_WINDOW = 256
DEFAULT_MIN_SAMPLES = 16
DEFAULT_MAX_KEYS = 1024


class _Window:
    """The last ``size`` lengths, in arrival order and sorted (censored ones as ``inf``)."""

    __slots__ = ("arrivals", "size", "sorted")

    def __init__(self, size: int) -> None:
        self.size = size
        self.arrivals: deque[float] = deque()
        self.sorted: list[float] = []

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
    samples: int
    censored: int
    #: The quantile's length in tokens; None while it is censored (an answer cut at its limit).
    predicted_tokens: int | None


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
        self._windows: OrderedDict[tuple[str, str | None], _Window] = OrderedDict()
        self._lock = threading.Lock()

    def predict(self, limit: int, route: str, tenant: str | None = None) -> int:
        """Tokens to reserve for an answer of at most ``limit`` tokens: the learnt quantile, at most
        ``limit``; ``limit`` itself until enough answers of this route (and tenant) were seen."""
        with self._lock:
            window = self._window(route, tenant)
            if window is None:
                return limit
            length = window.quantile(self.quantile)
        return limit if length >= limit else max(1, math.ceil(length))

    def survival(self, tokens: int, later: int, route: str, tenant: str | None = None) -> float:
        """The chance that an answer which has generated ``tokens`` goes on past ``later`` tokens:
        the share of the answers of its route (and tenant, as :meth:`predict` chooses) longer than
        ``tokens`` that were also longer than ``later``. 1.0 while fewer than ``min_samples``
        answers got past ``tokens`` (nothing known: it goes on); a censored answer goes on past any."""
        with self._lock:
            window = self._window(route, tenant)
            if window is None:
                return 1.0
            ordered = window.sorted
            reached = len(ordered) - bisect.bisect_right(ordered, tokens)
            if reached < self.min_samples:
                return 1.0
            return (len(ordered) - bisect.bisect_right(ordered, max(tokens, later))) / reached

    def _window(self, route: str, tenant: str | None) -> _Window | None:
        """The (route, tenant) window once it has enough answers, else the route's; None: neither."""
        window = self._windows.get((route, tenant)) if tenant is not None else None
        if window is None or len(window.sorted) < self.min_samples:
            window = self._windows.get((route, None))
            if window is None or len(window.sorted) < self.min_samples:
                return None
        return window

    def observe(self, tokens: int, route: str, tenant: str | None = None, *, truncated: bool = False) -> None:
        """An answer of ``tokens`` tokens ended; ``truncated`` when its own limit cut it (it would
        have been longer)."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        length = math.inf if truncated else float(tokens)
        with self._lock:
            self._add((route, None), length)
            if tenant is not None:
                self._add((route, tenant), length)

    def _add(self, key: tuple[str, str | None], length: float) -> None:
        windows = self._windows
        window = windows.get(key)
        if window is None:
            window = windows[key] = _Window(self.window)
            while len(windows) > self.max_keys:
                windows.popitem(last=False)
        else:
            windows.move_to_end(key)
        window.add(length)

    def statistics(self) -> tuple[LengthStatistics, ...]:
        """Each key's samples and prediction, most recently used last."""
        with self._lock:
            items = [(key, len(w.sorted), sum(map(math.isinf, w.sorted)), w) for key, w in self._windows.items()]
            rows = []
            for (route, tenant), samples, censored, window in items:
                predicted = None
                if samples >= self.min_samples:
                    length = window.quantile(self.quantile)
                    predicted = None if math.isinf(length) else max(1, math.ceil(length))
                rows.append(LengthStatistics(route, tenant, samples, censored, predicted))
        return tuple(rows)

    def __repr__(self) -> str:
        return f"OutputLengths(quantile={self.quantile}, window={self.window}, min_samples={self.min_samples})"
