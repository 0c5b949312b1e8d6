"""Typed, time-bounded calls of the shared ledger's Lua scripts, and the snapshot they return."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from redis.asyncio import Redis
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import MaxConnectionsError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..contract import DeviceStatistics, LedgerStatistics
from ..drain import MIN_BUSY_SPAN, RATE_WINDOW, drain_rate
from ..fair_share import DEFAULT_TENANT_IDLE_TTL, Lead, Standing
from ..forecast import predicted_wait
from ..tenants import DEFAULT_POLICY, TenantPolicy, TenantStatistics
from . import script_source

_KEYS = (
    "expiry", "lease", "ticket", "queue", "reserved", "inflight", "counts", "released", "boot", "lanes", "tenants",
    "holder",
)  # fmt: skip
_LEASE = _KEYS.index("lease")


#: What the reserve script does with a request it cannot grant at once (see ``LedgerScripts.reserve``).
ReserveMode = Literal["queue", "wait", "try"]

#: Pause before asking an exhausted non-blocking connection pool again.
POOL_RETRY_SECONDS = 0.002


class RedisDown(Exception):
    """Redis could not be reached."""


@dataclass(frozen=True, slots=True)
class Confirmation:
    """A grant as the server a call reached sees it (``LedgerScripts.confirm``)."""

    #: The server holds the lease.
    held: bool
    #: The address the connection reached it at: (host, port); ("", 0) for a Unix socket.
    address: tuple[str, int]
    #: Replicas that acknowledged every write before the call (``WAIT``); 0 when none was asked for.
    acked: int


class RedisSlow(RedisDown):
    """No answer within the timeout (a busy Redis, or a wait for a pooled connection): not an
    outage by itself; the caller asks the probe whether Redis is up."""


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pairs(flat: Sequence[Any]) -> dict[str, int]:
    return {text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}


@dataclass(frozen=True, slots=True)
class Beat:
    """One heartbeat's answer: the ids Redis no longer knows, and the state across every worker."""

    missing: tuple[str, ...] = ()
    reserved: dict[str, int] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    waiting: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    released_bytes: float = 0.0
    busy_seconds: float = 0.0
    #: name -> (bytes held, leases, waiting, bytes waiting, byte-seconds served)
    tenants: dict[str, tuple[int, int, int, int, float]] = field(default_factory=dict)
    #: name -> its place in the fair-share order (for Retry-After)
    standings: dict[str, Standing] = field(default_factory=dict)

    @property
    def waiting_bytes(self) -> int:
        return self.counts.get("waiting_bytes", 0)

    @property
    def release_rate(self) -> float:
        """Bytes given back per busy second as of the snapshot's instant, by the in-process ledger's rule (``drain``)."""
        return drain_rate(self.released_bytes, self.busy_seconds)

    def statistics(
        self,
        capacities: Mapping[str, int],
        local_rejections: Mapping[str, int],
        policy: Callable[[str], TenantPolicy] | None = None,
    ) -> LedgerStatistics:
        devices = tuple(
            DeviceStatistics(name, capacity, self.reserved.get(name, 0), self.in_flight.get(name, 0))
            for name, capacity in capacities.items()
        )
        rejected = {key.removeprefix("rejected:"): n for key, n in self.counts.items() if key.startswith("rejected:")}
        for reason, n in local_rejections.items():
            rejected[reason] = rejected.get(reason, 0) + n
        admitted = self.counts.get("admitted", 0)
        tenants = []
        for name, (held, leases, waiting, waiting_bytes, served) in sorted(self.tenants.items()):
            known = policy(name) if policy is not None else DEFAULT_POLICY
            tenants.append(
                TenantStatistics(name, known.weight, known.quota_bytes, held, leases, waiting, waiting_bytes, served)
            )
        return LedgerStatistics(
            devices, self.waiting, self.waiting_bytes, admitted, rejected, self.release_rate, tuple(tenants),
            self.counts.get("failovers", 0),
        )

    def retry_after(
        self,
        capacities: Mapping[str, int],
        nbytes: int,
        max_wait: float,
        priority: int,
        max_bypass: int,
        tenant: str,
        *,
        quota: int | None,
    ) -> float:
        """As :meth:`Ledger.retry_after <gpu_asgi.Ledger.retry_after>`, from this snapshot;
        ``quota`` is ``tenant``'s ``quota_bytes`` (the config's, which the snapshot does not carry)."""
        lanes = []
        for key, n in self.counts.items():
            if key.startswith("bytes:"):
                lane = key.removeprefix("bytes:")
                p, c, _, owner = lane.split(":", 3)  # "<priority>:<class>:<devices>:<tenant>"
                lanes.append((int(p), int(c), owner, self.counts.get("n:" + lane, 1), n))
        free = sum(capacity - self.reserved.get(name, 0) for name, capacity in capacities.items())
        return predicted_wait(
            lanes, tenant, nbytes, priority, self.standings, free, self.release_rate, max_bypass, max_wait, quota
        )


@dataclass(frozen=True, slots=True)
class Full:
    """The reserve script's refusal: ``waiting`` requests queued already (the tenant's own, when
    ``own_bound``), and the shared state of that instant (for its ``Retry-After``)."""

    waiting: int
    state: Beat
    own_bound: bool = False


class LedgerScripts:
    """The scripts bound to one namespace's keys; every call ends within ``timeout`` seconds."""

    #: name -> script text (``script_source.SCRIPTS``, the package's ``.lua`` files).
    texts: Mapping[str, str] = script_source.SCRIPTS

    def __init__(
        self,
        client: Redis,
        namespace: str,
        capacities: Mapping[str, int],
        *,
        lease_ttl: float,
        heartbeat: float,
        max_bypass: int,
        max_queue: int,
        timeout: float,
        tenants: Mapping[str, TenantPolicy] | None = None,
        default_tenant_policy: TenantPolicy = DEFAULT_POLICY,
        tenant_idle_ttl: float = DEFAULT_TENANT_IDLE_TTL,
    ) -> None:
        if "{" in namespace or "}" in namespace:
            raise ValueError("the namespace may not contain braces (they are Redis Cluster hash tags)")
        tag = "{" + namespace + "}"
        self.keys = [f"{tag}:{name}" for name in _KEYS]
        self.channel = f"{tag}:wake"
        #: Written before a ``WAIT``, so that the wait covers every write before it (``replicated``).
        self.fence = f"{tag}:fence"
        self.timeout = timeout
        self.client = client
        #: The dataset this process last saw (see script_source: data loss); '' until the first heartbeat.
        self.boot = ""
        config = {"caps": dict(capacities), "ttl": round(lease_ttl * 1000), "bypass": max_bypass, "queue": max_queue}
        config |= {"chan": self.channel, "window": RATE_WINDOW, "span": MIN_BUSY_SPAN}
        config |= {"warm": round(1.5 * heartbeat * 1000), "beat": round(heartbeat * 1000)}
        # Weights go as JSON numbers (repr: exact); a quota of 0 and a max_queue of -1 mean none.
        config |= {
            "tenants": {name: _policy(p) for name, p in (tenants or {}).items()},
            "default": _policy(default_tenant_policy),
            "idle": max(1, round(tenant_idle_ttl * 1000)),
        }
        self._config = json.dumps(config)
        self._index = {name: i for i, name in enumerate(capacities)}
        self._scripts = {name: client.register_script(text) for name, text in self.texts.items()}

    def _argv(self, args: tuple[str | int, ...]) -> list[str | int]:
        """A call's ARGV: the config, the boot id this process last saw, then the script's own."""
        return [self._config, self.boot, *args]

    @contextlib.asynccontextmanager
    async def _bounded(self) -> AsyncIterator[None]:
        """One call to Redis: within the timeout, its failures as ``RedisSlow`` or ``RedisDown``."""
        try:
            async with asyncio.timeout(self.timeout):
                yield
        except (TimeoutError, RedisTimeoutError) as exc:  # ours, the socket's or redis-py's
            raise RedisSlow(f"no answer within {self.timeout:g} s") from exc
        except (RedisError, OSError) as exc:
            raise RedisDown(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from exc

    async def _run(self, name: str, *args: str | int) -> Any:
        script = self._scripts[name]
        async with self._bounded():
            while True:
                try:
                    return await script(keys=self.keys, args=self._argv(args))
                except MaxConnectionsError:
                    # A caller's client with redis-py's default (non-blocking) pool, all of its
                    # connections busy: that is a burst, not an outage. Wait for one.
                    await asyncio.sleep(POOL_RETRY_SECONDS)

    async def confirm(self, id: str, replicas: int) -> Confirmation:
        """What the server one pooled connection reaches says of the grant ``id`` (made by any
        process's script): whether it holds the lease, and how many replicas (at most
        ``replicas``) have every write it made before this call: a write on this connection, then
        ``WAIT`` for it. The replication stream is ordered, so that covers the grant. The
        connection's address comes back too (behind Sentinel, the address the sentinels gave it
        when it connected). One round trip, bounded by the timeout."""
        commands: list[tuple[str | int, ...]] = [("HEXISTS", self.keys[_LEASE], id)]
        if replicas:
            commands += [("INCR", self.fence), ("WAIT", replicas, max(1, round(self.timeout * 500)))]
        pool = self.client.connection_pool
        async with self._bounded():
            while True:
                try:
                    connection = await pool.get_connection()  # type: ignore[no-untyped-call, unused-ignore]
                    break
                except MaxConnectionsError:  # as in _run: a burst, not an outage
                    await asyncio.sleep(POOL_RETRY_SECONDS)
            try:
                await connection.send_packed_command(connection.pack_commands(commands))
                replies = [await connection.read_response() for _ in commands]
            except BaseException:  # a reply left unread must not reach the next user of the connection
                await connection.disconnect()
                raise
            finally:
                await pool.release(connection)
        address = (str(getattr(connection, "host", "")), int(getattr(connection, "port", 0)))
        return Confirmation(bool(replies[0]), address, int(replies[-1]) if replicas else 0)

    @overload
    async def reserve(
        self, id: str, nbytes: int, devices: Sequence[str], priority: int, tenant: str, mode: Literal["queue"] = ...
    ) -> tuple[str, str] | Full: ...

    @overload
    async def reserve(
        self, id: str, nbytes: int, devices: Sequence[str], priority: int, tenant: str, mode: Literal["wait"]
    ) -> tuple[str, str] | Beat | Full: ...

    @overload
    async def reserve(
        self, id: str, nbytes: int, devices: Sequence[str], priority: int, tenant: str, mode: Literal["try"]
    ) -> tuple[str, str]: ...

    async def reserve(
        self, id: str, nbytes: int, devices: Sequence[str], priority: int, tenant: str, mode: ReserveMode = "queue"
    ) -> tuple[str, str] | Beat | Full:
        """``("granted", device)``, ``("queued", position)``, or :class:`Full` when the queue is at
        its bound (no ticket is taken). A request that cannot be granted at once is queued in mode
        ``"queue"``; in mode ``"wait"`` the state of that moment comes back instead (a :class:`Beat`,
        for the deadline decision); in mode ``"try"``, ``("busy", "")``. Neither takes a ticket.

        ``devices`` in the ledger's order. Asking again with the same id answers the first ask's state.
        """
        indexes = ",".join(str(self._index[name]) for name in devices)
        devs = json.dumps(list(devices))
        answer = await self._run("reserve", id, nbytes, devs, indexes, priority, tenant, mode)
        state, detail = text(answer[0]), answer[1]
        if state == "wait":
            return _beat((), detail)
        if state == "full":
            return Full(int(detail), _beat((), answer[2]), own_bound=len(answer) > 3)
        if state == "busy":
            return "busy", ""
        return state, text(detail)

    async def claim(self, id: str) -> tuple[str, str]:
        """``("granted", device)``, ``("waiting", _)``, or ``("gone", _)`` when Redis lost the ticket."""
        state, detail = await self._run("claim", id)
        return text(state), text(detail)

    async def leave(self, id: str, reason: str = "") -> bool:
        """Drop ``id``'s ticket and any lease granted to it; True if a lease was given back."""
        return bool(await self._run("leave", id, reason))

    async def leave_and_read(self, id: str, reason: str, tenant: str) -> Beat:
        """As :meth:`leave`, and the shared state just after it (with ``tenant``'s row), in the same call."""
        _, snapshot = await self._run("leave", id, reason, tenant)
        return _beat((), snapshot)

    async def release(self, id: str, keep: int, finished: bool) -> None:
        await self._run("release", id, keep, "1" if finished else "0")

    async def restore(self, id: str, nbytes: int, device: str, tenant: str) -> None:
        await self._run("restore", id, nbytes, device, tenant)

    async def heartbeat(self, ids: Sequence[str], rejections: Mapping[str, int] | None = None) -> Beat:
        """Renew ``ids``, add ``rejections`` (reason -> refusals decided without Redis) to the shared
        counts, and return the snapshot just after."""
        await self._follow_primary()
        missing, snapshot = await self._run("heartbeat", json.dumps(dict(rejections or {})), *ids)
        self.boot = text(snapshot[6])
        return _beat(tuple(text(id) for id in missing), snapshot)

    async def _follow_primary(self) -> None:
        """Behind Sentinel, ask the sentinels for the primary: redis-py then drops the idle
        connections to another one, and those in use as they come back. Once a beat, so that a
        heartbeat does not keep renewing leases on an old primary back from a stall (which the new
        one lacks, and would grant again) after the sentinels have moved. If no sentinel answers,
        the beat goes on the connections there are."""
        pool = self.client.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(self.timeout):
                    await pool.get_master_address()  # type: ignore[no-untyped-call, unused-ignore]


def _beat(missing: tuple[str, ...], snapshot: Sequence[Any]) -> Beat:
    """A :class:`Beat` from the scripts' ``snapshot()``."""
    reserved, in_flight, waiting, counts, released, busy, _, tenants = snapshot
    return Beat(
        missing=missing,
        reserved=_pairs(reserved),
        in_flight=_pairs(in_flight),
        waiting=int(waiting),
        counts=_pairs(counts),
        released_bytes=float(released),
        busy_seconds=float(busy),
        tenants={
            text(name): (int(held), int(leases), int(queued), int(queued_bytes), float(served))
            for name, held, leases, queued, queued_bytes, served, *_ in tenants
        },
        standings={
            text(name): Standing(
                float(vt),
                int(queued),
                int(leases),
                Lead(float(credit), text(low), float(high_credit), text(high)),
                float(rate),
                int(held),
            )
            for name, held, leases, queued, _, _, vt, credit, low, high_credit, high, rate in tenants
        },
    )


def _policy(policy: TenantPolicy) -> tuple[float, int, int]:
    return (policy.weight, policy.quota_bytes or 0, -1 if policy.max_queue is None else policy.max_queue)
