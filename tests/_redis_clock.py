"""A test-only variant of the Redis ledger's scripts that read the time from a test's clock.

The production scripts take the Redis server's ``TIME`` (``lua/clock.lua``) and no call carries a
clock. Here ``clock.lua`` is swapped for a line that takes the time, in milliseconds, from the
last argument, which :class:`ClockedScripts` appends to every call; the rest of each script is
the production text. Every ledger that shares a namespace must use the same clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from gpu_asgi._ledger.redis.ledger import RedisLedger
from gpu_asgi._ledger.redis.script_source import NAMES, compose
from gpu_asgi._ledger.redis.scripts import LedgerScripts

TEST_CLOCK = "-- Tests only: the time in ms is the call's last argument.\nlocal now = tonumber(table.remove(ARG))\n"


class ClockedScripts(LedgerScripts):
    """The scripts with the time from ``clock`` (seconds)."""

    texts: Mapping[str, str] = MappingProxyType({name: compose(name, clock=TEST_CLOCK) for name in NAMES})

    def __init__(self, *args: Any, clock: Callable[[], float], **options: Any) -> None:
        super().__init__(*args, **options)
        self.clock = clock

    def _argv(self, args: tuple[str | int, ...]) -> list[str | int]:
        return [*super()._argv(args), str(round(self.clock() * 1000))]


def clocked(clock: Callable[[], float]) -> type[RedisLedger]:
    """A ``RedisLedger`` class whose ledgers read time from ``clock``."""

    class Scripts(ClockedScripts):
        def __init__(self, *args: Any, **options: Any) -> None:
            super().__init__(*args, clock=clock, **options)

    class ClockedRedisLedger(RedisLedger):
        scripts_type = Scripts

    return ClockedRedisLedger


#: The tests' Redis answer timeout unless a test sets its own (those about timeouts and faults
#: do): past the 1 s default, a loaded CI machine can stall a first script call, and a slow
#: answer rightly sends a request down another path than the one a test checks.
REDIS_TIMEOUT = 10.0


def redis_ledger(*args: Any, clock: Callable[[], float] | None = None, **options: Any) -> RedisLedger:
    """``RedisLedger(*args, **options)``, ``redis_timeout`` :data:`REDIS_TIMEOUT` unless given;
    with ``clock``, one that reads time from it."""
    kind = RedisLedger if clock is None else clocked(clock)
    return kind(*args, **{"redis_timeout": REDIS_TIMEOUT, **options})
