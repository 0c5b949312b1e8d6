"""Work-based fair share between tenants: each tenant's bytes held, and its virtual time.

A tenant's virtual time ``vt`` is the integral of the bytes it holds over time, divided by its
weight (byte-seconds per unit of weight), brought up to date lazily. Dispatch serves the tenant
with the lowest ``vt`` first. A tenant that starts waiting is lifted so that it has no more lead
over the tenants it was measured against when its last waiter left (the lowest and the highest of
the others then) than it had; it keeps its standing, but time without waiters banks no credit. This
module keeps the accounts; the decision itself is the ledger's (docs/admission.md, "Tenants and
fair share"). The Redis ledger keeps the same accounts in Lua (``redis/lua/prelude.lua``) with the same
arithmetic in the same order, so both backends compute the same floats.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from .._errors import OverTenantQuota
from .drain import DrainRate
from .tenants import TenantPolicy, TenantStatistics

#: Seconds a tenant with nothing held and nothing waiting is remembered (its virtual time with it).
DEFAULT_TENANT_IDLE_TTL = 300.0


def check_quota(policy: TenantPolicy, nbytes: int) -> None:
    """Refuse at once a request larger than its tenant's whole quota: waiting cannot help it."""
    quota = policy.quota_bytes
    if quota is not None and nbytes > quota:
        raise OverTenantQuota(
            f"The request needs {nbytes} bytes of GPU memory; its tenant may hold at most {quota} bytes.",
            required_bytes=nbytes,
            quota_bytes=quota,
        )


@dataclass(frozen=True, slots=True)
class Lead:
    """How far a tenant's ``vt`` was below two others' when its last waiter left: the lowest of
    the others then (``credit``) and the highest (``high_credit``), by name ('' for none)."""

    credit: float = 0.0
    low: str = ""
    high_credit: float = 0.0
    high: str = ""


NO_LEAD = Lead()


@dataclass(frozen=True, slots=True)
class Standing:
    """A tenant's place in the fair-share order at one moment (what ``Retry-After`` needs)."""

    vt: float
    waiting: int
    in_flight: int
    lead: Lead = NO_LEAD
    #: Bytes admitted per second while it had a waiter (``Account.admissions``); 0 while unknown.
    rate: float = 0.0
    #: Bytes it holds (its quota's share in use: ``forecast.quota_wait``).
    held: int = 0


def measure(others: Mapping[str, float], vt: float) -> Lead:
    """The lead of a tenant at ``vt`` over ``others`` (name -> vt, the ones ``lift`` reads): over
    the lowest and the highest of them, ties going to the first name in code-point order."""
    if not others:
        return NO_LEAD
    by_name = sorted(others.items())  # min and max keep the first of equals: the Lua scripts do the same
    low = min(by_name, key=lambda item: item[1])
    high = max(by_name, key=lambda item: item[1])
    return Lead(max(0.0, low[1] - vt), low[0], max(0.0, high[1] - vt), high[0])


def lift(others: Mapping[str, float], lead: Lead) -> float | None:
    """The virtual time a tenant that starts waiting is lifted to (at least), or None.

    Against the tenants its lead was measured against that are still among ``others``: no more
    lead over either than it had, and never behind the lowest of ``others``. When neither is, its
    lead over the lowest then is applied to the lowest now.
    """
    if not others:
        return None
    floor = min(others.values())
    pairs = ((lead.low, lead.credit), (lead.high, lead.high_credit))
    kept = [others[name] - credit for name, credit in pairs if name in others]
    return min(floor, max(kept)) if kept else floor - lead.credit


def others_of(standings: Mapping[str, tuple[float, int, int]], tenant: str) -> dict[str, float]:
    """Of ``standings`` (name -> (vt, waiting, in flight)), the others a tenant is lifted against:
    those that wait, or those that hold when none waits."""
    waiting = {name: vt for name, (vt, waits, _) in standings.items() if waits and name != tenant}
    return waiting or {name: vt for name, (vt, _, holds) in standings.items() if holds and name != tenant}


def arrival_vt(standings: Mapping[str, Standing], tenant: str) -> float:
    """The virtual time a request of ``tenant`` arriving now is ordered by: its own, lifted as
    :meth:`FairShare.queued` lifts a tenant's first waiter."""
    mine = standings.get(tenant)
    vt = 0.0 if mine is None else mine.vt
    if mine is None or not mine.waiting:
        others = others_of({name: (s.vt, s.waiting, s.in_flight) for name, s in standings.items()}, tenant)
        target = lift(others, NO_LEAD if mine is None else mine.lead)
        if target is not None and target > vt:
            vt = target
    return vt


def lanes_ahead(
    lanes: Iterable[tuple[int, int, str, int, int]], tenant: str, priority: int, standings: Mapping[str, Standing]
) -> Iterator[tuple[int, int, int, int]]:
    """Of ``lanes`` (priority, size class, tenant, waiters, bytes), those a request of ``tenant``
    at ``priority`` is ordered behind, as (priority, size class, waiters, bytes) for
    ``bytes_ahead``: its own tenant's at its priority or higher, and every lane of a tenant whose
    virtual time is below the one it arrives with (across tenants, virtual time decides; at a tie
    the other tenant, which holds bytes, is behind by the next release)."""
    mine: float | None = None
    for p, c, owner, waiters, nbytes in lanes:
        if owner == tenant:
            yield p, c, waiters, nbytes
            continue
        if mine is None:
            mine = arrival_vt(standings, tenant)
        other = standings.get(owner)
        if other is not None and other.vt < mine:
            yield max(p, priority), c, waiters, nbytes


class Account:
    """One tenant's share of a ledger."""

    __slots__ = (
        "admissions", "held", "in_flight", "last", "lead", "name", "policy", "served", "vt", "waiting", "waiting_bytes",
    )  # fmt: skip

    def __init__(self, name: str, policy: TenantPolicy, now: float) -> None:
        self.name = name
        self.policy = policy
        self.held = 0
        self.in_flight = 0
        self.waiting = 0
        self.waiting_bytes = 0
        #: Byte-seconds per unit of weight held up to ``last``.
        self.vt = 0.0
        #: Byte-seconds held up to ``last``.
        self.served = 0.0
        self.last = now
        #: How far its ``vt`` was below the others' when its last waiter left.
        self.lead = NO_LEAD
        #: Bytes of its waiters admitted per second of time it had a waiter: how fast its own
        #: queue moves, net of what tenants ordered before it take (``Retry-After``).
        self.admissions = DrainRate(now)

    def vt_at(self, now: float) -> float:
        """The virtual time at ``now``, without bringing it up to date (so the stored value only
        changes at the events both ledgers share: grants, releases, lifts)."""
        if now > self.last:
            return self.vt + self.held * (now - self.last) / self.policy.weight
        return self.vt

    def advance(self, now: float) -> None:
        if now > self.last:
            elapsed = now - self.last
            self.vt = self.vt + self.held * elapsed / self.policy.weight
            self.served = self.served + self.held * elapsed
            self.last = now

    def fits(self, nbytes: int) -> bool:
        """False while holding ``nbytes`` more would exceed the quota."""
        quota = self.policy.quota_bytes
        return quota is None or self.held + nbytes <= quota


class FairShare:
    """Every known tenant's :class:`Account`; an idle one is forgotten after ``idle_ttl`` seconds.

    Every method that reads or writes accounts at an instant ``now`` first forgets the tenants
    idle for ``idle_ttl`` by then (``forget_idle``), so whichever path a request takes, no account
    is kept or used past its ttl: the same as the Redis ledger, whose idle tenants' hashes expire.
    The methods without ``now`` read only counts (held, waiting), which are 0 in an idle account as
    in a forgotten one.
    """

    def __init__(self, policies: Mapping[str, TenantPolicy], default: TenantPolicy, idle_ttl: float) -> None:
        self.policies = policies  # checked by the ledger (tenants.check_tenant_options)
        self.default = default
        self.idle_ttl = idle_ttl
        self.accounts: dict[str, Account] = {}
        #: The tenants that hold or wait.
        self.active: dict[str, Account] = {}
        #: Idle tenants, oldest first, with when they became idle.
        self._idle: OrderedDict[str, float] = OrderedDict()
        #: No later than when the oldest idle tenant became idle (inf: none is idle): until
        #: ``idle_ttl`` has passed since, no account can have expired, and ``account`` (on every
        #: grant and release) pays one comparison instead of a call of ``forget_idle``.
        self._oldest_idle = math.inf

    def policy(self, name: str) -> TenantPolicy:
        return self.policies.get(name, self.default)

    def account(self, name: str, now: float) -> Account:
        if now - self._oldest_idle >= self.idle_ttl:  # one may have expired: never revive it
            self.forget_idle(now)
        account = self.accounts.get(name)
        if account is None:
            account = self.accounts[name] = Account(name, self.policy(name), now)
        return account

    def waiting(self, name: str) -> int:
        """Requests of ``name`` waiting now."""
        account = self.accounts.get(name)
        return 0 if account is None else account.waiting

    def fits(self, name: str, nbytes: int) -> bool:
        """Whether ``name`` may hold ``nbytes`` more now under its quota. The caller has refused
        already what the whole quota could never hold (``LedgerBase._check_quota``)."""
        policy = self.policy(name)
        if policy.quota_bytes is None:  # the common case: one lookup, no account needed
            return True
        account = self.accounts.get(name)
        return account is None or account.fits(nbytes)  # no account holds nothing, and nbytes <= quota

    def hold(self, name: str, nbytes: int, reservations: int, now: float) -> None:
        """``nbytes`` more (or fewer) held by ``name``, in ``reservations`` more (or fewer) reservations."""
        account = self.account(name, now)
        account.advance(now)
        account.held += nbytes
        account.in_flight += reservations
        if reservations:  # only a reservation's start or end can turn the tenant active or idle
            self._touch(account, now)

    def queued(self, name: str, nbytes: int, now: float) -> None:
        """A waiter joins; the tenant's first one lifts its virtual time (no credit banked without waiters)."""
        account = self.account(name, now)
        account.admissions.advance(now, busy=True)
        if not account.waiting:
            account.advance(now)
            target = lift(self._others(account, now), account.lead)
            if target is not None and target > account.vt:
                account.vt = target
        account.waiting += 1
        account.waiting_bytes += nbytes
        self._touch(account, now)

    def left(self, name: str, nbytes: int, now: float, *, admitted: bool = False) -> None:
        """A waiter left the queue (admitted, timed out or cancelled); the last one records the lead."""
        account = self.account(name, now)
        account.waiting -= 1
        account.waiting_bytes -= nbytes
        account.admissions.advance(now, busy=account.waiting > 0)
        if admitted:
            account.admissions.released(nbytes)
        if not account.waiting:
            account.lead = measure(self._others(account, now), account.vt_at(now))
        self._touch(account, now)

    def _others(self, account: Account, now: float) -> dict[str, float]:
        """The virtual times of the other tenants that wait (of those that hold, when none waits)."""
        return others_of({a.name: (a.vt_at(now), a.waiting, a.in_flight) for a in self.active.values()}, account.name)

    def _touch(self, account: Account, now: float) -> None:
        """Move ``account`` between ``active`` and the idle tenants (nothing held, nothing waiting)
        when its counts just turned it idle or active; nothing to do while it stays active."""
        name = account.name
        if account.in_flight or account.waiting:
            if name not in self.active:
                self.active[name] = account
                self._idle.pop(name, None)
        elif self.active.pop(name, None) is not None:  # it just turned idle: the newest idle, last
            if not self._idle:
                self._oldest_idle = now
            self._idle[name] = now

    def forget_idle(self, now: float) -> None:
        """Drop the accounts idle for ``idle_ttl`` seconds: random tenant keys cannot grow memory.

        Oldest first, so a call costs the accounts it drops (each idle spell is dropped at most
        once) and one look at the oldest one kept, whatever the number of tenants.
        """
        idle = self._idle
        while idle:
            name, since = next(iter(idle.items()))
            if now - since < self.idle_ttl:
                self._oldest_idle = since
                return
            del idle[name]
            del self.accounts[name]
        self._oldest_idle = math.inf

    def standings(self, now: float, tenant: str) -> dict[str, Standing]:
        """The :class:`Standing` at ``now`` of the tenants that hold or wait, and of ``tenant``
        (what ``lanes_ahead`` reads: idle tenants, however many, play no part)."""
        self.forget_idle(now)
        accounts = dict(self.active)
        if tenant in self.accounts:
            accounts[tenant] = self.accounts[tenant]
        return {
            name: Standing(a.vt_at(now), a.waiting, a.in_flight, a.lead, a.admissions.rate_at(now), a.held)
            for name, a in accounts.items()
        }

    def statistics(self, now: float) -> tuple[TenantStatistics, ...]:
        """Every tenant that holds or waits, and every configured one, by name."""
        self.forget_idle(now)
        rows = []
        for name in sorted({*self.policies, *self.active}):
            account = self.accounts.get(name) or Account(name, self.policy(name), now)
            served = account.served + (account.held * (now - account.last) if now > account.last else 0.0)
            policy = account.policy
            rows.append(
                TenantStatistics(
                    name,
                    policy.weight,
                    policy.quota_bytes,
                    account.held,
                    account.in_flight,
                    account.waiting,
                    account.waiting_bytes,
                    served,
                )
            )
        return tuple(rows)
