"""The drain rate behind ``Retry-After``: bytes given back per second of busy time.

An exponentially weighted average with a time constant of ``RATE_WINDOW`` seconds that counts
only time when something was reserved: an idle spell neither lowers nor raises the rate, so the
first burst after a quiet minute is answered with the rate the GPU drains at when it works.

Over ``e`` busy seconds both sums decay by ``d = exp(-e / RATE_WINDOW)`` and the busy seconds
grow by ``RATE_WINDOW * (1 - d)``: the exact continuous average of busy time. Advancing over
``[t0, t2]`` in one step or at any instants in between gives the same numbers, so the rate at an
instant depends only on the history of releases and busy time, never on how often a ledger
happened to look. Both ledgers read it as of the instant asked (``rate_at``); the Redis ledger
computes the same in Lua (``redis/lua/prelude.lua``).
"""

from __future__ import annotations

import math

#: Time constant of the average, in busy seconds.
RATE_WINDOW = 30.0
#: The hint's clamp, in seconds; finite for any settings.
MIN_RETRY_AFTER = 1.0
MAX_RETRY_AFTER = 600.0
#: Weighted busy seconds below which a rate is not trusted yet (one early release would read as a flood).
MIN_BUSY_SPAN = 1.0


class DrainRate:
    """Released bytes and busy seconds, both decayed by ``exp(-busy seconds / RATE_WINDOW)``."""

    __slots__ = ("busy", "bytes", "last", "seconds")

    def __init__(self, now: float) -> None:
        self.bytes = 0.0
        self.seconds = 0.0
        self.last = now
        self.busy = False

    def advance(self, now: float, busy: bool) -> None:
        """Account for the time since the last call; ``busy`` says whether bytes are reserved from now on."""
        if now > self.last:  # a clock that stands still or steps back adds nothing
            self.bytes, self.seconds = self._at(now)
            self.last = now
        self.busy = busy

    def _at(self, now: float) -> tuple[float, float]:
        """Bytes and busy seconds decayed to ``now`` (unchanged while idle or before ``last``)."""
        elapsed = now - self.last
        if self.busy and elapsed > 0:
            decay = math.exp(-elapsed / RATE_WINDOW)
            # 1 - decay, not -expm1: the Lua scripts (which have no expm1) then compute the same
            # floats from the same events; what 1 - decay loses is below 1e-15 s per step.
            return self.bytes * decay, self.seconds * decay + RATE_WINDOW * (1 - decay)
        return self.bytes, self.seconds

    def released(self, nbytes: int) -> None:
        self.bytes += nbytes

    def rate_at(self, now: float) -> float:
        """The rate as if advanced to ``now`` (:func:`drain_rate`): time busy since the last
        grant or release counts, so a rate that stopped moving reads slower as it waits."""
        return drain_rate(*self._at(now))


def drain_rate(nbytes: float, seconds: float) -> float:
    """Bytes per busy second from the decayed sums; 0 (unknown) until a release has been seen
    and ``MIN_BUSY_SPAN`` weighted busy seconds have passed."""
    return nbytes / seconds if nbytes > 0 and seconds >= MIN_BUSY_SPAN else 0.0


def retry_after(backlog: int, rate: float, max_wait: float) -> float:
    """Seconds until ``backlog`` bytes have drained at ``rate``, clamped to the documented range.

    With no rate yet, ``max_wait`` (itself clamped) is the hint.
    """
    if rate > 0:
        hint = backlog / rate
    else:
        hint = max_wait
    if not hint == hint:  # NaN (max_wait=nan): nothing better to say than the floor
        hint = MIN_RETRY_AFTER
    return min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, hint))
