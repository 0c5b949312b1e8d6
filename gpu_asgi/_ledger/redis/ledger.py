"""One VRAM budget shared by every worker process and host, kept in Redis.

``uvicorn --workers N`` runs N event loops; an in-process :class:`~gpu_asgi.Ledger` in each sees
only its own requests, so together they over-commit the GPU. :class:`RedisLedger` keeps the same
interface and semantics with one budget per device across all of them:

- reserve and release are atomic Lua scripts on the server (``lua/*.lua``) that apply the
  in-process ledger's decision rule to one global queue, so no worker's waiters starve another's;
  a script looks only at lane heads, so its cost does not grow with the number of waiters;
- waiters are woken by pub/sub, with a slow poll as the fallback;
- each reservation is a lease renewed by a heartbeat (``upkeep``): a crashed worker's
  bytes come back within ``lease_ttl``; a spell in which Redis ran no script (stalled, cut off)
  ages leases one heartbeat only, since nobody could renew them (``script_source``, the lease
  clock); leases Redis lost while still held are put back;
- Redis unreachable (or a call slower than ``redis_timeout`` and a ``PING`` on the probe's own
  connection too): :class:`~gpu_asgi.LedgerUnavailable` (503) by default, or an in-process ledger
  with ``local_share`` of each budget and tenant quota; Redis back: used again without a restart.
  A call that is only slow leaves the request waiting.

``pip install 'gpu_asgi[redis]'``; see docs/deployment.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import warnings
from collections.abc import Awaitable, Mapping, Sequence
from typing import ClassVar, Literal, Self, TypeVar

from redis.asyncio import ConnectionPool, Redis

from ..._errors import DeadlineUnmeetable, LedgerUnavailable, NeverFits, OverTenantQuota, QueueFull, QueueTimeout
from ..base import LedgerBase, on_ledger_thread
from ..contract import (
    DEFAULT_MAX_BYPASS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_WAIT,
    DEFAULT_REDIS_TIMEOUT,
    MAX_TIMEOUT,
    Availability,
    LedgerStatistics,
    Reservation,
    check_priority,
)
from ..fair_share import DEFAULT_TENANT_IDLE_TTL
from ..forecast import queue_timeout
from ..memory import Ledger
from ..tenants import DEFAULT_POLICY, DEFAULT_TENANT, TenantPolicy
from .connect import is_sentinel_url, redis_client
from .primary import SentinelPrimary
from .scripts import Beat, Full, LedgerScripts, RedisDown, RedisSlow
from .upkeep import RETRIES, Upkeep, cancels

__all__ = ["RedisLedger"]

_Answer = TypeVar("_Answer")

DEFAULT_NAMESPACE = "gpu_asgi"
DEFAULT_LEASE_TTL = 10.0
#: Waiters are woken by pub/sub; this poll is the fallback (and the pace while the channel is down).
DEFAULT_POLL_INTERVAL = 2.0
#: The poll while this process's wake-up subscription is not up yet (or lost).
UNSUBSCRIBED_POLL_INTERVAL = 0.05
DEFAULT_MAX_CONNECTIONS = 32
#: How long a request that timed out in the queue waits for Redis's state of that moment, for its
#: ``Retry-After`` (a healthy Redis answers in about a millisecond); past it, the heartbeat
#: snapshot's, and the queue exit finishes in the background.
TIMEOUT_STATE_WAIT = 0.1
#: ``_ask``'s answer when a call was only slow: the request waits as if queued, and its next claim
#: (by the same id) finds out whether the call landed. No script answers this.
SLOW = ("waiting", "")


class RedisLedger(LedgerBase):
    """Byte budgets shared through Redis by every process that uses the same ``namespace``.

    ``redis`` is a URL (``redis://host:6379/0``, ``rediss://``, ``unix://``, or Sentinel's
    ``redis+sentinel://host:26379,host2:26379/service/0``: ``connect``) or a
    ``redis.asyncio.Redis`` client. One ledger per process and event loop; call
    ``await ledger.aclose()`` on shutdown (or use ``async with``). A client made from a URL
    has a blocking pool of ``max_connections``: a burst of admissions waits its turn for a
    connection (within ``redis_timeout``) rather than failing; with a client you pass in whose
    pool raises when exhausted (redis-py's default), calls retry until one is free.

    ``tenants``, ``default_tenant_policy`` and ``tenant_idle_ttl`` as the in-process ledger's:
    every process sharing the namespace must configure the same tenants (the weights and quotas
    travel with each call, so processes that disagree decide by different rules). Time is the
    Redis server's ``TIME``.

    ``replicas``: a grant is used only once that many replicas have it (``WAIT``), so a failover
    cannot lose it (None: 1 for a ``redis+sentinel://`` URL, else 0); a failover also pauses
    grants while every worker puts back what the new primary lacks (docs/deployment.md, "Failover").
    """

    #: The scripts' caller; a test may give a subclass a variant (tests/_redis.py: a fake clock).
    scripts_type: ClassVar[type[LedgerScripts]] = LedgerScripts

    def __init__(
        self,
        redis: str | Redis,
        capacity: int | Mapping[str, int],
        *,
        namespace: str = DEFAULT_NAMESPACE,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        heartbeat: float | None = None,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_wait: float = DEFAULT_MAX_WAIT,
        max_bypass: int = DEFAULT_MAX_BYPASS,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        notify: bool = True,
        redis_timeout: float = DEFAULT_REDIS_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        on_unavailable: Literal["fail-closed", "local"] = "fail-closed",
        local_share: float | None = None,
        tenants: Mapping[str, TenantPolicy] | None = None,
        default_tenant_policy: TenantPolicy = DEFAULT_POLICY,
        tenant_idle_ttl: float = DEFAULT_TENANT_IDLE_TTL,
        replicas: int | None = None,
    ) -> None:
        super().__init__(
            capacity,
            max_queue=max_queue,
            max_wait=max_wait,
            max_bypass=max_bypass,
            tenants=tenants,
            default_tenant_policy=default_tenant_policy,
            tenant_idle_ttl=tenant_idle_ttl,
        )
        capacities = self._capacities
        heartbeat = lease_ttl / 3 if heartbeat is None else heartbeat
        if not 0 < heartbeat < lease_ttl:
            raise ValueError(
                "heartbeat must be positive and shorter than lease_ttl (a third leaves two beats of slack)"
            )
        if max_connections < 2:
            raise ValueError("max_connections must be at least 2: the wake-up subscription holds one")
        if on_unavailable not in ("fail-closed", "local"):
            raise ValueError("on_unavailable must be 'fail-closed' or 'local'")
        if on_unavailable == "local" and not (local_share is not None and 0 < local_share <= 1):
            raise ValueError(
                "on_unavailable='local' needs local_share in (0, 1]: the part of each budget one process may "
                "use alone, at most 1 / the number of processes sharing the GPU"
            )
        if replicas is not None and replicas < 0:
            raise ValueError("replicas must be >= 0")
        self.namespace = namespace
        #: A grant is used only once this many replicas have it (``WAIT``): a failover cannot lose
        #: it then. None: 1 behind Sentinel (a ``redis+sentinel://`` URL), else 0.
        self.replicas = (1 if isinstance(redis, str) and is_sentinel_url(redis) else 0) if replicas is None else replicas
        self.lease_ttl = lease_ttl
        self.heartbeat = heartbeat
        self.poll_interval = min(poll_interval, heartbeat)  # waiters also keep their tickets alive
        self.redis_timeout = redis_timeout
        self.on_unavailable = on_unavailable
        self.local_share = local_share
        self._owns_client = isinstance(redis, str)
        if isinstance(redis, str):  # one immediate retry reconnects after a restart or a failover
            redis = redis_client(redis, max_connections=max_connections, timeout=redis_timeout)
        self._client = redis
        #: Behind Sentinel, who is the primary now: a grant from any other server is never used.
        self._primary = SentinelPrimary.of(redis)
        self._scripts = self.scripts_type(
            redis,
            namespace,
            capacities,
            lease_ttl=lease_ttl,
            heartbeat=heartbeat,
            max_bypass=max_bypass,
            max_queue=max_queue,
            timeout=redis_timeout,
            tenants=self.tenants,
            default_tenant_policy=default_tenant_policy,
            tenant_idle_ttl=tenant_idle_ttl,
        )
        # The probe's own connection: a busy pool never makes Redis look down.
        base = redis.connection_pool
        probe_pool = ConnectionPool(connection_class=base.connection_class, max_connections=1, **base.connection_kwargs)
        self._probe_client = Redis.from_pool(probe_pool)
        self._upkeep = Upkeep(
            self._scripts, redis, self._probe_client,
            name=namespace, heartbeat=heartbeat, notify=notify, primary=self._primary,
        )  # fmt: skip
        self._local: Ledger | None = None
        if on_unavailable == "local" and local_share is not None:
            # Every process decides alone meanwhile: each gets local_share of each budget and of each quota.
            share = {name: max(1, int(nbytes * local_share)) for name, nbytes in capacities.items()}
            self._local = Ledger(
                share,
                max_queue=max_queue,
                max_wait=max_wait,
                max_bypass=max_bypass,
                tenants={name: _local_policy(policy, local_share) for name, policy in self.tenants.items()},
                default_tenant_policy=_local_policy(default_tenant_policy, local_share),
                tenant_idle_ttl=tenant_idle_ttl,
            )
        self._inner: dict[str, Reservation] = {}  # the local-ledger reservation behind a fallback one
        self._unavailable_total = 0  # rejections that never reached Redis, so counted here
        self._statistics: tuple[Beat, int, int, LedgerStatistics] | None = None

    def __repr__(self) -> str:
        budgets = ", ".join(f"{name}={nbytes}" for name, nbytes in self._capacities.items())
        return (
            f"RedisLedger({budgets}, namespace={self.namespace!r}, lease_ttl={self.lease_ttl}, "
            f"max_queue={self.max_queue}, max_wait={self.max_wait}, max_bypass={self.max_bypass}, "
            f"on_unavailable={self.on_unavailable!r})"
        )

    @property
    def available(self) -> bool:
        """False from a failed Redis call until the next one that succeeds."""
        return self._upkeep.down is None

    @property
    def availability(self) -> Availability:
        """``"available"`` while Redis answers; else ``"local"`` (``on_unavailable="local"``) or
        ``"unavailable"`` (fail-closed), from a failed call until the next one that succeeds."""
        if self._upkeep.down is None:
            return "available"
        return "local" if self._local is not None else "unavailable"

    # -- admission ----------------------------------------------------------------------

    def try_reserve(
        self, nbytes: int, *, devices: Sequence[str] | None = None, tenant: str = DEFAULT_TENANT
    ) -> Reservation | None:
        """Deprecated: always None (a synchronous call cannot ask Redis); ``await reserve_if_free()``."""
        warnings.warn(
            "RedisLedger.try_reserve() always answers None; await reserve_if_free(), which asks Redis",
            DeprecationWarning,
            stacklevel=2,
        )
        return None

    async def reserve_if_free(
        self, nbytes: int, *, devices: Sequence[str] | None = None, tenant: str = DEFAULT_TENANT
    ) -> Reservation | None:
        """The bytes now if they fit in the shared budget and nobody waits, within the tenant's
        quota; else None, and nothing queued: one call of the reserve script in its no-queue mode.

        None too while Redis is unavailable, or when the call was only slow (any lease it may
        have been granted is given back): :meth:`reserve` then decides, with its fallback.
        """
        names = self._choose(devices, nbytes)
        self._check_quota(tenant, nbytes)
        upkeep = self._upkeep
        upkeep.start()
        if upkeep.skipping():
            return None
        rid, settled = upkeep.new_id(), False
        try:
            state, device = await self._scripts.reserve(rid, nbytes, names, 0, tenant, "try")
            if state == "granted":
                await self._confirmed(rid)
            settled = True
        except RedisDown as exc:
            if not isinstance(exc, RedisSlow):
                upkeep.went_down(exc)
            return None
        finally:
            if not settled:  # it may have landed: give back what it may have granted
                upkeep.leave(rid, "")
        upkeep.came_up()
        if state != "granted":
            return None
        return self._hold(Reservation(self, rid, device, nbytes, 0.0, tenant))

    async def reserve(
        self,
        nbytes: int,
        *,
        devices: Sequence[str] | None = None,
        priority: int = 0,
        tenant: str = DEFAULT_TENANT,
        deadline: float | None = None,
        timeout: float | None = None,
        wait_limit: float | None = None,
    ) -> Reservation:
        """Reserve ``nbytes`` for ``tenant`` on one of ``devices`` from the shared budget, queueing if needed.

        As :meth:`Ledger.reserve <gpu_asgi.Ledger.reserve>`, plus :class:`~gpu_asgi.LedgerUnavailable`
        when Redis fails and ``on_unavailable`` is ``"fail-closed"``. As in-process, a request that
        fits now is granted and the wait (``deadline``, cut to ``max_wait``) bounds the wait in the
        queue: the first ask, which grants at once what fits, is not cut short by it (its one call,
        two with a ``deadline``, each bounded by ``redis_timeout``, and a slow one by as long again
        for the probe's ``PING``). Once the request has joined the queue it never waits past that
        by more than ``TIMEOUT_STATE_WAIT`` (0.1 s, to read the state its ``Retry-After`` is
        computed from), whatever Redis does. With a ``deadline``, a request that cannot be granted
        at once is decided on the shared state of that moment, which the reserve script returns
        instead of queueing it; one more call then queues it (or grants it, if bytes came free).
        """
        check_priority(priority)
        first_limit, wait = self._wait_bounds(deadline, timeout, wait_limit)
        limit: float | None = first_limit  # None once the deadline rule has decided
        names = self._choose(devices, nbytes)
        self._check_quota(tenant, nbytes)
        upkeep = self._upkeep
        upkeep.start()
        loop = asyncio.get_running_loop()
        queue_wait, start, cancelled = min(wait, MAX_TIMEOUT), loop.time(), cancels()
        if upkeep.skipping():
            return await self._fallback(nbytes, names, priority, queue_wait, tenant)
        rid = upkeep.new_id()
        wake = upkeep.waiters[rid] = asyncio.Event()
        settled, reason = False, ""
        until: float | None = None  # the end of the wait, set once the first ask has answered
        predicted: float | None = None  # the wait the deadline rule let it queue on
        try:
            # The first ask, outside the timeout: it grants what fits now, else joins the queue.
            state, detail, limit, predicted = await self._join(rid, nbytes, names, priority, tenant, limit, predicted)
            until = loop.time() + queue_wait
            async with asyncio.timeout_at(until):
                while state != "granted":
                    if cancels() > cancelled:  # a cancellation redis-py swallowed: see cancels()
                        raise asyncio.CancelledError
                    if state == "gone":  # the first ask was only slow and did not land, or Redis lost the queue
                        state, detail, limit, predicted = await self._join(
                            rid, nbytes, names, priority, tenant, limit, predicted
                        )
                        continue
                    poll = self.poll_interval if upkeep.listening else UNSUBSCRIBED_POLL_INTERVAL
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(poll):
                            await wake.wait()
                    wake.clear()
                    if upkeep.skipping():  # another call found Redis down meanwhile
                        raise RedisDown(upkeep.down)
                    granted = upkeep.grants.pop(rid, None)  # the wake-up names the device: no round trip
                    state, detail = ("granted", granted) if granted else await self._ask(self._scripts.claim(rid))
            await self._confirmed(rid)
            settled = True
            return self._hold(Reservation(self, rid, detail, nbytes, loop.time() - start, tenant))
        except (DeadlineUnmeetable, QueueFull):
            settled = True  # refused by the reserve script: no ticket was taken
            raise
        except TimeoutError:
            reason = QueueTimeout.reason
            leaving = upkeep.spawn(self._leave_and_read(rid, reason, tenant))
            settled = leaving is not None  # that task leaves the queue, even if this one is cancelled
            state_after = None
            if leaving is not None:
                done, _ = await asyncio.wait([leaving], timeout=TIMEOUT_STATE_WAIT)
                state_after = leaving.result() if done else None
            # Redis's state just after the waiter left; the heartbeat's snapshot if it did not come in time.
            hint = self._retry_after(upkeep.beat if state_after is None else state_after, nbytes, priority, tenant)
            raise queue_timeout(nbytes, wait, hint, predicted) from None
        except RedisDown as exc:
            upkeep.went_down(exc)
        finally:
            del upkeep.waiters[rid]
            upkeep.grants.pop(rid, None)
            if not settled:  # leave the queue, and give back a lease granted as we gave up
                upkeep.leave(rid, reason)
        # Redis failed: the local ledger's queue gets what is left of the wait (all of it, if the
        # request never joined Redis's queue).
        remaining = queue_wait if until is None else max(0.0, until - loop.time())
        return await self._fallback(nbytes, names, priority, remaining, tenant)

    async def _join(
        self, rid: str, nbytes: int, names: tuple[str, ...], priority: int, tenant: str, limit: float | None,
        predicted: float | None,
    ) -> tuple[str, str, float | None, float | None]:
        """Ask the reserve script: ``(state, detail)`` granted or queued (or ``SLOW``'s waiting, for a
        claim to find out), the deadline ``limit`` still to be decided at a next join (None once it
        is), and the wait predicted when it was (``predicted`` until then).

        With a finite ``limit``, the deadline decision on the state the script returns when the
        request cannot be granted at once, then one more call to queue it. Raises the refusals
        (:class:`~gpu_asgi.DeadlineUnmeetable`, :class:`~gpu_asgi.QueueFull`), which take no ticket.
        """
        scripts = self._scripts
        mode: Literal["queue", "wait"] = "queue" if limit is None or limit >= MAX_TIMEOUT else "wait"
        answer = await self._ask(scripts.reserve(rid, nbytes, names, priority, tenant, mode))
        if answer == SLOW:  # it may not have landed: a join after the claim says "gone" decides the deadline
            return *SLOW, limit, predicted
        if isinstance(answer, Beat):  # it must queue: the deadline decision, on that moment's state
            beat = answer
            assert limit is not None  # the script answers with its state only when asked in "wait" mode
            predicted = self._refuse_unmeetable(
                limit, beat.release_rate, lambda: self._retry_after(beat, nbytes, priority, tenant)
            )
            answer = await self._ask(scripts.reserve(rid, nbytes, names, priority, tenant))
        if isinstance(answer, Full):
            raise self._queue_full(answer, nbytes, priority, tenant)
        return *answer, None, predicted

    def _queue_full(self, full: Full, nbytes: int, priority: int, tenant: str) -> QueueFull:
        """The refusal, its ``Retry-After`` from the state the reserve script refused it on."""
        message = (
            f"{full.waiting} requests of this tenant are already waiting for GPU memory (its limit)."
            if full.own_bound
            else f"{full.waiting} requests are already waiting for GPU memory."
        )
        return QueueFull(message, retry_after=self._retry_after(full.state, nbytes, priority, tenant))

    async def _leave_and_read(self, rid: str, reason: str, tenant: str) -> Beat | None:
        """Leave the queue (giving back a lease granted as the waiter gave up) and read the shared
        state just after, in one call; if it fails, None, and the exit is retried as any other
        (``Upkeep.leave``; after a call that was only slow and did land, it finds nothing to drop
        but counts the rejection again)."""
        try:
            state = await self._scripts.leave_and_read(rid, reason, tenant)
        except RedisDown as exc:
            if not isinstance(exc, RedisSlow):
                self._upkeep.went_down(exc)
            await self._upkeep.leaving(rid, reason)
            return None
        self._upkeep.came_up()
        return state

    def _retry_after(self, beat: Beat, nbytes: int, priority: int, tenant: str) -> float:
        quota = self.tenant_policy(tenant).quota_bytes
        return beat.retry_after(self._capacities, nbytes, self.max_wait, priority, self.max_bypass, tenant, quota=quota)

    async def _ask(self, call: Awaitable[_Answer]) -> _Answer | tuple[str, str]:
        """A script's answer; ``SLOW`` when it was only slow and Redis answers the probe (the next
        claim, by the same id, finds out what happened)."""
        try:
            answer = await call
        except RedisSlow:
            if not await self._upkeep.probe():
                raise
            return SLOW
        self._upkeep.came_up()
        return answer

    async def _fallback(
        self, nbytes: int, names: tuple[str, ...], priority: int, timeout: float, tenant: str
    ) -> Reservation:
        local = self._local
        if local is None:
            self._unavailable_total += 1
            raise LedgerUnavailable(
                f"The shared GPU ledger (Redis) is unavailable ({self._upkeep.down}); admission fails closed.",
                retry_after=self.heartbeat,
            )
        try:
            inner = await local._reserve(nbytes, names, priority, tenant, math.inf, timeout)  # the wait left, no new rule
        except NeverFits as exc:
            self._unavailable_total += 1
            raise LedgerUnavailable(
                f"The shared GPU ledger (Redis) is unavailable and {nbytes} bytes exceed this process's "
                f"local share ({exc.extensions['budget_bytes']} bytes).",
                retry_after=self.heartbeat,
            ) from None
        except OverTenantQuota as exc:  # within the tenant's quota (checked first), not within this share of it
            self._unavailable_total += 1
            raise LedgerUnavailable(
                f"The shared GPU ledger (Redis) is unavailable and {nbytes} bytes exceed this process's "
                f"local share of its tenant's quota ({exc.extensions['quota_bytes']} bytes).",
                retry_after=self.heartbeat,
            ) from None
        rid = self._upkeep.new_id()
        self._inner[rid] = inner
        return self._hold(Reservation(self, rid, inner.device, nbytes, inner.waited, tenant))

    def _count_rejection(self, reason: str) -> None:
        """A refusal decided before any call to Redis: counted here, added to Redis by the next heartbeat."""
        self._upkeep.tally.count(reason)

    async def _confirmed(self, rid: str) -> None:
        """Return once the grant ``rid`` is safe to use, else raise ``RedisDown`` (the caller gives
        it back): with ``replicas``, that many replicas have it (a failover cannot lose it); behind
        Sentinel, the server that holds it is the primary the sentinels name (an old primary back
        from a stall may grant from a stale dataset: ``primary``)."""
        primary = self._primary
        if not self.replicas and primary is None:
            return
        seen = await self._scripts.confirm(rid, self.replicas)
        if seen.acked < self.replicas:
            raise RedisDown(
                f"{seen.acked} of {self.replicas} replica(s) acknowledged the grant within {self.redis_timeout:g} s"
            )
        if not seen.held:  # granted by another server than the one this connection reaches
            raise RedisDown("the grant is not on the Redis server this process reaches")
        if primary is not None and not await primary.names(seen.address, self.redis_timeout):
            # This connection reaches an old primary: let the pool ask the sentinels again.
            await self._client.connection_pool.disconnect(inuse_connections=False)
            raise RedisDown("the Redis server that granted is not the primary the sentinels name")

    def _hold(self, reservation: Reservation) -> Reservation:
        self._upkeep.held[reservation.id] = reservation
        return reservation

    def give_back(self, reservation: Reservation, nbytes: int, *, finished: bool) -> None:
        """Take back ``nbytes`` of ``reservation``: Redis is told what it keeps (its ``nbytes`` now),
        an absolute amount, sent after every earlier change of the lease (``Upkeep.release``), so a
        retried call never gives bytes back twice."""
        on_ledger_thread(self._upkeep.loop, self._upkeep.thread, self._returned, reservation, reservation.nbytes, finished)

    def grow(self, reservation: Reservation, nbytes: int) -> None:
        """Count ``nbytes`` more for ``reservation``, past the budget if need be: Redis is told what
        it holds now (its ``nbytes``), as for a shrink; see ``BudgetLedger``."""
        on_ledger_thread(self._upkeep.loop, self._upkeep.thread, self._grown, reservation, reservation.nbytes)

    def _grown(self, reservation: Reservation, hold: int) -> None:
        rid, upkeep = reservation.id, self._upkeep
        inner = self._inner.get(rid)
        if inner is not None:  # granted by the local fallback: that ledger counts the growth too
            inner.grow(hold)
        if inner is None or rid in upkeep.restored:
            upkeep.release(rid, hold, False, grows=True)

    def _returned(self, reservation: Reservation, keep: int, finished: bool) -> None:
        rid, upkeep = reservation.id, self._upkeep
        inner = self._inner.pop(rid, None) if finished else self._inner.get(rid)
        if inner is not None:
            inner.release() if finished else inner.shrink(keep)
        if finished:
            upkeep.held.pop(rid, None)
        if inner is None or rid in upkeep.restored:  # it is (also) in Redis
            if finished:
                upkeep.restored.discard(rid)
            upkeep.release(rid, keep, finished)

    # -- lifecycle ----------------------------------------------------------------------

    async def refresh_statistics(self) -> LedgerStatistics:
        """Renew this process's leases and tickets now and return a fresh shared snapshot.

        The heartbeat does this every ``heartbeat`` seconds. While Redis is unavailable the last
        snapshot stays (see :attr:`available`).
        """
        self._upkeep.start()
        await self._upkeep.refresh()
        return self.statistics()

    async def aclose(self) -> None:
        """Stop the heartbeat, let pending releases land (bounded), close a client made from a URL."""
        await self._upkeep.aclose(drain_timeout=self.redis_timeout * RETRIES + 1)
        await self._probe_client.aclose()
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> Self:
        self._upkeep.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- rates and statistics -------------------------------------------------------------

    def retry_after(self, nbytes: int = 0, *, priority: int = 0, tenant: str = DEFAULT_TENANT) -> float:
        """As the in-process ledger's, from the last heartbeat's snapshot (up to ``heartbeat`` s old;
        a tenant that neither holds nor waits nor is configured is not in it).

        The ``Retry-After`` of a ``queue-full`` or ``queue-timeout`` refusal is not this: it is
        computed from Redis's state at the refusal (docs/admission.md, "Retry-After of a refusal,
        with Redis").
        """
        return self._retry_after(self._upkeep.beat, nbytes, priority, tenant)

    def statistics(self) -> LedgerStatistics:
        """Every worker's reservations and queue, as of the last heartbeat (at most ``heartbeat`` s old).

        While Redis is unavailable and ``on_unavailable="local"``, the local fallback ledger's.
        """
        if self._local is not None and self._upkeep.down is not None:
            return self._local.statistics()
        beat, tally, cached = self._upkeep.beat, self._upkeep.tally, self._statistics
        key = (beat, self._unavailable_total, tally.version)
        if cached is None or cached[0] is not beat or cached[1:3] != key[1:]:
            # This process's refusals Redis has not counted yet (the next heartbeat adds them), and
            # its ledger-unavailable ones, which only it knows of.
            local_rejections = tally.uncounted()
            if self._unavailable_total:
                local_rejections[LedgerUnavailable.reason] = self._unavailable_total
            cached = self._statistics = (
                *key,
                beat.statistics(self._capacities, local_rejections, self.tenant_policy),
            )
        return cached[3]  # the middleware asks once per request: built once per heartbeat


    def give_back_all(self) -> int:
        """Release every reservation this process still holds; returns the bytes given back.

        For a process that stops with requests still running (past its drain timeout): call it
        before :meth:`aclose`, and the other workers and hosts get those bytes now, not after
        ``lease_ttl``. Whatever still runs on the device stops with the process. (A request the
        server cancels releases its own bytes: the middleware releases them as it unwinds.)
        """
        return sum(reservation.release() for reservation in list(self._upkeep.held.values()))


def _local_policy(policy: TenantPolicy, local_share: float) -> TenantPolicy:
    """The policy one process applies alone while Redis is unavailable: ``local_share`` of its quota,
    rounded down and at least one byte (as each budget's share; a quota cannot be 0 bytes)."""
    if policy.quota_bytes is None:
        return policy
    return dataclasses.replace(policy, quota_bytes=max(1, int(policy.quota_bytes * local_share)))
