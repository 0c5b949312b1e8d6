"""What a ledger holds per tenant over time, kept from grants and releases, and how the time in
which every tenant has a request waiting ("all backlogged") divides between the tenants.

Issue 11's share bar counts each tenant's reserved bytes x seconds inside those windows. A
window opens when the last tenant without a waiter gets one; what the tenants hold then was
granted before it opened, and an admission layer cannot take it back. So the byte-seconds of a
window are split by when their reservation was granted:

- *inherited*: granted before the window opened (held when it opened, until released);
- *inside*: granted after it opened; ``inherited + inside`` is the bar's own measure.

And, for the rule's own choices, *granted work*: bytes x the whole time held of every
reservation granted while all tenants waited (the granted request's waiter counted as waiting),
whenever it ends. It is not cut off where a window closes, which matters because a window
closes exactly when a light tenant's last waiter is granted: truncated, that grant would count
for nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Grant:
    """One reservation as the tracker saw it granted."""

    tenant: str
    nbytes: int
    at: float
    #: The all-backlogged window open when it was granted (windows count from 1), 0 when none was.
    window: int


@dataclass
class Tracker:
    """Time integrals of what the ledger holds, per tenant, from ``wait`` / ``grant`` / ``release``."""

    capacity: int
    tenants: tuple[str, ...]
    clock: Callable[[], float]
    held: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    last: float = 0.0
    busy_area: float = 0.0  # integral of reserved / capacity while anyone waits
    busy_time: float = 0.0
    backlog_time: float = 0.0  # time during which every tenant has a request waiting
    backlog_byte_seconds: dict[str, float] = field(default_factory=dict)  # the bar's measure
    oom: int = 0
    running: Callable[[], int] = lambda: 0  # sequences on the simulated device now
    running_area: float = 0.0  # integral of that while anyone waits
    #: Windows opened so far; while one is open, its number.
    window: int = 0
    backlogged: bool = False
    #: (opened, closed) of every window; closed is None while it is open.
    windows: list[tuple[float, float | None]] = field(default_factory=list)
    #: Bytes held when the open window opened that are still held.
    inherited: dict[str, int] = field(default_factory=dict)
    inherited_byte_seconds: dict[str, float] = field(default_factory=dict)
    inside_byte_seconds: dict[str, float] = field(default_factory=dict)
    #: Bytes x whole time held of the reservations granted while a window was open, once released.
    granted_work: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for tenant in self.tenants:
            self.held[tenant] = self.waiting[tenant] = self.inherited[tenant] = 0
            for sums in (self.backlog_byte_seconds, self.inherited_byte_seconds, self.inside_byte_seconds,
                         self.granted_work):
                sums[tenant] = 0.0
        self.last = self.clock()

    def advance(self) -> None:
        now = self.clock()
        span = now - self.last
        if span > 0:
            if any(self.waiting.values()):
                self.busy_area += span * sum(self.held.values()) / self.capacity
                self.running_area += span * self.running()
                self.busy_time += span
            if self.backlogged:
                self.backlog_time += span
                for tenant, nbytes in self.held.items():
                    old = self.inherited[tenant]
                    self.backlog_byte_seconds[tenant] += span * nbytes
                    self.inherited_byte_seconds[tenant] += span * old
                    self.inside_byte_seconds[tenant] += span * (nbytes - old)
        self.last = now

    def wait(self, tenant: str, change: int) -> None:
        """A request of ``tenant`` starts (+1) or stops (-1) waiting without being granted."""
        self.advance()
        self.waiting[tenant] += change
        self._window()

    def grant(self, tenant: str, nbytes: int, *, waited: bool = True) -> Grant:
        """``nbytes`` granted to ``tenant``; ``waited``: to one of its waiters, which leaves the
        queue after the grant is stamped (so a grant that closes a window counts as made in it)."""
        self.advance()
        granted = Grant(tenant, nbytes, self.last, self.window if self.backlogged else 0)
        self.held[tenant] += nbytes
        if waited:
            self.waiting[tenant] -= 1
            self._window()
        return granted

    def release(self, granted: Grant) -> None:
        self.advance()
        tenant, nbytes = granted.tenant, granted.nbytes
        self.held[tenant] -= nbytes
        if self.backlogged and granted.window != self.window:  # held since before the open window opened
            self.inherited[tenant] -= nbytes
        if granted.window:
            self.granted_work[tenant] += nbytes * (self.last - granted.at)

    def _window(self) -> None:
        """Open or close the all-backlogged window as the waiters just changed."""
        everyone = all(self.waiting.values())
        if everyone and not self.backlogged:
            self.backlogged = True
            self.window += 1
            self.inherited = dict(self.held)
            self.windows.append((self.last, None))
        elif self.backlogged and not everyone:
            self.backlogged = False
            self.windows[-1] = (self.windows[-1][0], self.last)
