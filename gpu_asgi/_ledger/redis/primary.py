"""Whether the Redis server that made a grant is the primary the sentinels name now.

After a stall (``SIGSTOP``, a network partition) an old primary can come back still believing it
is the primary, before the sentinels demote it: it grants from its stale dataset, and a replica
the sentinels have not yet moved to the new primary still follows it and acknowledges the grant's
``WAIT``. The new primary never sees that grant, and grants the same bytes again. So behind
Sentinel a grant is used only when the sentinels, asked after it, name the address the grant
came from (the one they gave the connection when it connected) as the service's primary.

Every sentinel is asked at once. One that names another address, or whose primary is objectively
down or being failed over, refuses the grant; one that cannot be reached has no say. A majority of
them must answer and agree; once they have, the others get ``GRACE`` more to disagree. Before
any sentinel moves to a newly promoted primary nobody finds it, so nobody writes to it; once one
has, it refuses what the old primary grants.

The address, not the run id: a sentinel learns a new primary's run id only from its next periodic
``INFO`` (seconds after the switch, measured), while it gives the address at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.sentinel import SentinelConnectionPool

from .scripts import text

__all__ = ["GRACE", "SentinelPrimary"]

#: Once a majority of the sentinels agree, how long the others still have to answer (seconds).
GRACE = 0.05

#: A primary in these states is named by nobody: a grant from it now is refused.
_NOT_NAMED = frozenset({"o_down", "failover_in_progress"})


class SentinelPrimary:
    """The sentinels of one service, asked which address is its primary."""

    __slots__ = ("sentinels", "service")

    def __init__(self, sentinels: Sequence[Redis], service: str) -> None:
        if not sentinels:
            raise ValueError("no sentinels to ask")
        self.sentinels = tuple(sentinels)
        self.service = service

    @classmethod
    def of(cls, client: Redis) -> SentinelPrimary | None:
        """The sentinels behind ``client``'s pool (redis-py's ``Sentinel.master_for``), or None."""
        pool = client.connection_pool
        if not isinstance(pool, SentinelConnectionPool):
            return None
        return cls(pool.sentinel_manager.sentinels, pool.service_name)

    async def names(self, address: tuple[str, int], timeout: float) -> bool:
        """Whether the sentinels agree (:meth:`agreed`) that ``(host, port)`` is the primary."""
        return await self.agreed(timeout) == address

    async def agreed(self, timeout: float) -> tuple[str, int] | None:
        """The address a majority of the sentinels answering within ``timeout`` name as the primary,
        when every one that answers names it, neither objectively down nor being failed over; else
        None (they disagree while a failover spreads: the others learn it from the sentinels' hello
        messages, seconds later)."""
        asks = {asyncio.ensure_future(self._primary(sentinel)) for sentinel in self.sentinels}
        majority, agreed, named = len(asks) // 2 + 1, 0, None
        try:
            async with asyncio.timeout(timeout) as bound:
                while asks:
                    done, asks = await asyncio.wait(asks, return_when=asyncio.FIRST_COMPLETED)
                    for ask in done:
                        if ask.exception() is not None:
                            continue  # unreachable: no say
                        address = ask.result()
                        if address is None or named not in (None, address):
                            return None
                        named, agreed = address, agreed + 1
                    if agreed >= majority:
                        grace = asyncio.get_running_loop().time() + GRACE
                        bound.reschedule(min(grace, bound.when() or grace))
        except TimeoutError:
            pass
        finally:
            for ask in asks:
                ask.cancel()
        return named if agreed >= majority else None

    async def _primary(self, sentinel: Redis) -> tuple[str, int] | None:
        """The address this sentinel gives the primary; None when it names none it trusts now."""
        reply = await sentinel.execute_command("SENTINEL", "MASTER", self.service)  # type: ignore[no-untyped-call, unused-ignore]
        fields = _fields(reply)
        if _NOT_NAMED & set(fields.get("flags", "").split(",")):
            return None
        return fields.get("ip", ""), int(fields.get("port", "0"))


def _fields(reply: Any) -> dict[str, str]:
    """``SENTINEL MASTER``'s reply as text: a flat ``[name, value, ...]`` list, or the dict that
    redis-py's parser makes of it (its flags then a set in some versions)."""
    items = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
    return {
        text(name): ",".join(sorted(map(text, value))) if isinstance(value, set | frozenset) else text(value)
        for name, value in items
    }
