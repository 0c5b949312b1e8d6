"""The drain rate behind ``Retry-After``: bytes given back per second of busy time.

An exponentially weighted average with a time constant of ``RATE_WINDOW`` seconds that counts
only time when something was reserved: an idle spell neither lowers nor raises the rate, so the first burst after a quiet minute is answered with the rate
the GPU drains at when it works. The Redis ledger computes the same in Lua (``_redis_lua``).
"""

from __future__ import annotations

import math

#: Time constant of the average, in busy seconds.
RATE_WINDOW = 30.0
#: The hint's clamp, in seconds; finite for any settings.
MIN_RETRY_AFTER = 1.0
MAX_RETRY_AFTER = 600.0
#: Busy seconds below which a rate is not trusted yet (one early release would read as a flood).
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
            return self.bytes * decay, self.seconds * decay + elapsed
        return self.bytes, self.seconds

    def released(self, nbytes: int) -> None:
        self.bytes += nbytes

    def rate_at(self, now: float) -> float:
        """The rate as if advanced to ``now``; 0 until ``MIN_BUSY_SPAN`` busy seconds are seen.

        A tenant's admission rate is read this way: time it has waited since its last admission
        counts, and a rate from a moment of backlog is not trusted.
        """
        nbytes, seconds = self._at(now)
        return nbytes / seconds if nbytes > 0 and seconds >= MIN_BUSY_SPAN else 0.0

    @property
    def rate(self) -> float:
        """Bytes per busy second; 0 until a release has been seen."""
        return self.bytes / max(self.seconds, MIN_BUSY_SPAN) if self.bytes > 0 else 0.0


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
