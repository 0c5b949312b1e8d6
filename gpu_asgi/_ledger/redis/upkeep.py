"""What one process owes the shared ledger, done in the background.

- A heartbeat renews this process's leases and tickets (a crashed process's expire instead) and
  brings back the shared snapshot behind ``statistics()``; after a beat that did not land, the
  next comes half a heartbeat later (see ``_heartbeat_forever``).
- Leases Redis lost while they are still held here (a restart without persistence, an outage
  longer than the TTL) are put back, so the shared budget counts bytes really in use.
- Wake-ups: one pub/sub subscription per process hands each grant to its waiter.
- Availability: a call that cannot reach Redis marks it down until a call succeeds; meanwhile
  admission does not wait on it (``skipping``) and the heartbeat keeps probing. A call that is
  only slow (a busy Redis, a wait for a pooled connection) marks it down only if a ``PING`` on a
  connection of its own also goes unanswered within the timeout (``probe``).
- Behind Sentinel, a beat counts as landed only once the sentinels agree on the primary
  (``SentinelPrimary.agreed``): while a failover spreads, admission stays down, as the check on
  each grant would refuse it anyway.
- Releases and queue exits are tracked tasks, retried briefly. One that still fails (Redis away:
  down, restarting, failing over) is owed: sent again by the first heartbeat that lands, so the
  bytes and the queue's order come back as soon as Redis answers, not a lease TTL later (which
  stays the backstop, for a process that dies first).
- Refusals decided before any call to Redis (``exceeds-budget``, ``exceeds-tenant-quota``) are
  counted here (``Tally``) and added to Redis's counts by the next heartbeat, in the same call: a
  burst of them costs no call, and a beat that fails keeps them for the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.exceptions import RedisError

from ..contract import Reservation
from .primary import SentinelPrimary
from .scripts import Beat, LedgerScripts, RedisDown, RedisSlow, text

#: Tries for a release or a queue exit that cannot reach Redis; the lease TTL is the backstop.
RETRIES = 3

_Result = TypeVar("_Result")

logger = logging.getLogger("gpu_asgi.redis_ledger")


class Tally:
    """This process's refusals (reason -> count) that Redis has not counted yet."""

    def __init__(self) -> None:
        self._pending: Counter[str] = Counter()  # for the next heartbeat
        self._sending: Counter[str] = Counter()  # in a heartbeat's call now (beats may overlap)
        #: Changes whenever ``uncounted()`` may have; ``statistics()`` caches on it.
        self.version = 0

    def count(self, reason: str) -> None:
        self._pending[reason] += 1
        self.version += 1

    def uncounted(self) -> dict[str, int]:
        """Counted here, not (as far as this process knows) in Redis yet."""
        return dict(self._pending + self._sending)

    def take(self) -> dict[str, int]:
        """The counts for a heartbeat to add; ``landed`` or ``failed`` with them once it has answered."""
        batch = dict(self._pending)
        self._pending.clear()
        self._sending.update(batch)
        return batch

    def landed(self, batch: dict[str, int]) -> None:
        self._sending.subtract(batch)
        self._sending = +self._sending  # drop the zeros
        self.version += 1

    def failed(self, batch: dict[str, int]) -> None:
        """Back for the next beat. A beat that was only slow (or cancelled) may have landed all the
        same: its counts are then added twice. Rare, and the other choice is losing them."""
        self._sending.subtract(batch)
        self._sending = +self._sending
        self._pending.update(batch)
        self.version += 1


class Upkeep:
    def __init__(
        self,
        scripts: LedgerScripts,
        client: Redis,
        probe_client: Redis,
        *,
        name: str,
        heartbeat: float,
        notify: bool,
        primary: SentinelPrimary | None = None,
    ) -> None:
        self.scripts = scripts
        self.primary = primary
        self.client = client
        self.probe_client = probe_client
        self._probing: asyncio.Future[bool] | None = None
        #: True while the wake-up subscription is up: waiters then poll only as a slow fallback.
        self.listening = False
        self.name = name
        self.heartbeat = heartbeat
        self.notify = notify
        self.held: dict[str, Reservation] = {}
        self.waiters: dict[str, asyncio.Event] = {}
        self.grants: dict[str, str] = {}  # waiter id -> device, from wake-ups
        self.restored: set[str] = set()  # local-fallback reservations put into Redis since
        self.beat = Beat()
        self.tally = Tally()
        self.down: str | None = None  # why Redis is unavailable; None while it answers
        self.closed = False
        self._retry_at = 0.0
        self._restoring: dict[str, asyncio.Task[None]] = {}
        #: Each lease's last change sent (shrink, grow, release), which its next one waits for.
        self._changing: dict[str, asyncio.Task[None]] = {}
        #: Grows not landed yet, of any lease: a shrink or release made after them waits for them.
        self._growing: set[asyncio.Task[None]] = set()
        #: Lease changes and queue exits whose tries all failed, by id: the latest of each, sent
        #: again once a heartbeat lands (the amounts are absolute, so a repeat changes nothing).
        self.owed_releases: dict[str, tuple[int, bool]] = {}
        self.owed_leaves: dict[str, str] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []
        #: The event loop this ledger serves, and its thread (releases from others are handed to it).
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = 0
        self._owner = ""
        self._ids = itertools.count(1)

    def start(self) -> None:
        if self.closed:
            raise RuntimeError("this RedisLedger is closed")
        if not self._owner:  # chosen on first use, in the process that uses it (after any fork)
            self._owner = f"{socket.gethostname().replace(' ', '_')}:{os.getpid()}:{secrets.token_hex(3)}"
        loop = asyncio.get_running_loop()
        if self._loops and self._loops[0].get_loop() is not loop:
            previous = self._loops[0].get_loop()
            if previous.is_running() and not previous.is_closed():
                raise RuntimeError(
                    "this RedisLedger already serves another running event loop: create one per event loop"
                )
            self._loops = []  # that loop has stopped: its tasks will never run again
        if not self._loops or self._loops[0].done():
            self.loop, self.thread = loop, threading.get_ident()
            self._loops = [loop.create_task(self._heartbeat_forever(), name="gpu_asgi-redis-heartbeat")]
            if self.notify:
                self._loops.append(loop.create_task(self._listen_forever(), name="gpu_asgi-redis-wake"))

    def new_id(self) -> str:
        """Unique across processes and hosts: ``host:pid:random:n``."""
        return f"{self._owner}:{next(self._ids)}"

    # -- availability -----------------------------------------------------------------

    def skipping(self) -> bool:
        """True while Redis was just seen down: admission goes straight to the fallback."""
        return self.down is not None and time.monotonic() < self._retry_at

    def went_down(self, exc: Exception) -> None:
        if self.down is None:
            logger.warning("Redis ledger %r unavailable: %s", self.name, exc)
        self.down = str(exc)
        self._retry_at = time.monotonic() + self.heartbeat
        for wake in self.waiters.values():  # queued requests learn it now, not at their next poll
            wake.set()

    async def probe(self) -> bool:
        """Does Redis answer a ``PING`` within the timeout? One probe at a time, shared by all who ask."""
        if self._probing is None or self._probing.done():
            self._probing = asyncio.ensure_future(self._ping())
        return await asyncio.shield(self._probing)

    async def _ping(self) -> bool:
        try:
            async with asyncio.timeout(self.scripts.timeout):
                await self.probe_client.ping()
            return True
        except (RedisError, OSError):
            return False

    def came_up(self) -> None:
        if self.down is not None:
            logger.warning("Redis ledger %r available again", self.name)
            self.down = None

    # -- heartbeat and restores -------------------------------------------------------

    async def refresh(self) -> bool:
        """Renew, send the tally, take the snapshot; whether the beat landed."""
        rejections, beat = self.tally.take(), None
        try:
            beat = await self.scripts.heartbeat([*self.held, *self.waiters], rejections)
        except RedisSlow as exc:
            if not await self.probe():
                self.went_down(exc)
            return False  # up but busy: the next beat renews
        except RedisDown as exc:
            self.went_down(exc)
            return False
        finally:  # a beat with no answer (failed, slow, cancelled) leaves its counts to the next
            if beat is None:
                self.tally.failed(rejections)
            else:
                self.tally.landed(rejections)
        if self.primary is not None and await self.primary.agreed(self.scripts.timeout) is None:
            self.went_down(RedisDown("the sentinels do not yet agree on the primary"))
            return False
        self.came_up()
        self.beat = beat
        self._pay_owed()
        for rid in beat.missing:
            reservation = self.held.get(rid)
            if reservation is None or rid in self._restoring:
                continue
            if (task := self.spawn(self._restore(reservation))) is not None:
                self._restoring[rid] = task
        return True

    def _pay_owed(self) -> None:
        """Send again what failed while Redis was away (a change sent since supersedes its owed one)."""
        releases, self.owed_releases = self.owed_releases, {}
        for rid, (keep, finished) in releases.items():
            if rid not in self._changing:
                self.release(rid, keep, finished)
        leaves, self.owed_leaves = self.owed_leaves, {}
        for rid, reason in leaves.items():
            self.leave(rid, reason)

    async def _restore(self, reservation: Reservation) -> None:
        try:
            if not reservation.released:
                self.restored.add(reservation.id)
                await self.scripts.restore(reservation.id, reservation.nbytes, reservation.device, reservation.tenant)
        except RedisDown:
            pass  # the next heartbeat finds it missing again
        finally:
            self._restoring.pop(reservation.id, None)

    async def _heartbeat_forever(self) -> None:
        while not self.closed:
            landed = await self.refresh()
            # After a beat that did not land, the next comes half a heartbeat later: across a spell
            # in which Redis ran no script, leases age one heartbeat (script_source, the lease clock),
            # and renewing within half one of Redis serving again keeps a lease's margin.
            await asyncio.sleep(self.heartbeat if landed else self.heartbeat / 2)

    async def _listen_forever(self) -> None:
        while not self.closed:
            pubsub = self.client.pubsub()
            try:
                await pubsub.subscribe(self.scripts.channel)
                self.listening = True
                while not self.closed:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    for rid, device in json.loads(text(message["data"])).items() if message else ():
                        if (wake := self.waiters.get(rid)) is not None:
                            self.grants[rid] = device
                            wake.set()
            except (RedisError, OSError, ValueError) as exc:  # Redis away: waiters poll meanwhile
                logger.debug("wake-up channel lost: %r", exc)
            finally:
                self.listening = False
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed in redis-py >= 8
            await asyncio.sleep(self.heartbeat)

    # -- tracked background calls -------------------------------------------------------

    def release(self, rid: str, keep: int, finished: bool, *, grows: bool = False) -> None:
        """Tell Redis what lease ``rid`` keeps now (a shrink, a grow, or its end), after every
        earlier change of it: the amounts are absolute, so they must land in the order made.
        A shrink or release also lands after every grow made before it, of any lease: bytes moved
        from one lease to another (a grow, then a shrink) must never be free in Redis meanwhile,
        or another process would be granted them and the budget over-committed."""
        before = self._changing.get(rid)
        earlier = [] if before is None else [before]
        if not grows:
            earlier += self._growing
        task = self.spawn(self._release(rid, keep, finished, earlier))
        if task is not None:
            self._changing[rid] = task
            task.add_done_callback(functools.partial(self._changed, rid))
            if grows:
                self._growing.add(task)
                task.add_done_callback(self._growing.discard)

    def _changed(self, rid: str, task: asyncio.Task[None]) -> None:
        """Forget lease ``rid``'s last change once it has landed, unless a later one follows it."""
        if self._changing.get(rid) is task:
            del self._changing[rid]

    async def _release(self, rid: str, keep: int, finished: bool, earlier: list[asyncio.Task[None]]) -> None:
        restoring = self._restoring.get(rid)
        if restoring is not None:
            earlier = [restoring, *earlier]
        if earlier:  # a restore or the changes sent before this one that it must follow
            await asyncio.wait(earlier)
        self.owed_releases.pop(rid, None)  # this change supersedes an owed one
        if not await self.retrying(self.scripts.release, rid, keep, finished):
            self.owed_releases[rid] = (keep, finished)

    def leave(self, rid: str, reason: str) -> None:
        """Leave the queue, giving back a lease granted as the waiter gave up."""
        self.spawn(self.leaving(rid, reason))

    async def leaving(self, rid: str, reason: str) -> None:
        """:meth:`leave`, awaited: owed to the next heartbeat that lands if every try fails."""
        if not await self.retrying(self.scripts.leave, rid, reason):
            self.owed_leaves[rid] = reason

    async def retrying(self, call: Callable[..., Awaitable[Any]], *args: Any, tries: int = RETRIES) -> bool:
        """Whether ``call(*args)`` landed within ``tries``."""
        for attempt in range(tries):
            try:
                await call(*args)
                return True
            except RedisDown as exc:
                if attempt == tries - 1:
                    logger.warning(
                        "%s%s failed %d times (%s); sent again once Redis answers", call.__name__, args, tries, exc
                    )
                else:
                    await asyncio.sleep(0.05 * 4**attempt)
        return False

    def spawn(self, coro: Coroutine[Any, Any, _Result]) -> asyncio.Task[_Result] | None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # released with no loop running (shutdown): the lease TTL covers it
            coro.close()
            return None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def aclose(self, drain_timeout: float) -> None:
        self.closed = True
        while not all(task.done() for task in self._loops):
            for task in self._loops:  # again and again: see cancels()
                task.cancel()
            await asyncio.wait(self._loops, timeout=0.1)
        self._pay_owed()  # one more try for what failed while Redis was away
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=drain_timeout)
        for task in set(self._tasks):
            task.cancel()
        rejections = self.tally.take()
        if rejections:  # refusals no heartbeat has sent yet: one last call, which renews nothing
            try:
                await self.scripts.heartbeat([], rejections)
            except RedisDown as exc:
                self.tally.failed(rejections)
                logger.warning("Redis ledger %r closed without counting %s in Redis: %s", self.name, rejections, exc)


def cancels() -> int:
    """Cancellations requested of this task and not yet handled.

    On Python 3.11, ``asyncio.wait_for`` (which redis-py uses to send commands) drops a
    cancellation that lands just as the command completes; a rising count shows it happened.
    """
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0
