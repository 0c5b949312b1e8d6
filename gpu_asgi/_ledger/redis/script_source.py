"""The shared ledger's Lua scripts, read once from the package data in ``lua/``, and the state they keep in Redis.

Every key carries the hash tag ``{namespace}`` so a script's keys share one cluster slot:

- ``expiry``   sorted set, lease or ticket id → expiry (milliseconds of the lease clock, below);
  heartbeats renew it
- ``lease``    hash, lease id → ``"<bytes> <device>"``
- ``ticket``   hash, ticket id → ``{"n": bytes, "d": [devices], "p": priority, "s": sequence,
  "l": lane, "b": times passed}`` (JSON)
- ``queue``    sorted set, ticket id → sequence: every waiter, for counting
- ``lanes``    set of lane names ``"<priority>:<size class>:<device indexes>"``; each lane is a
  sorted set ``queue:<lane>``, ticket id → sequence (FIFO)
- ``reserved`` / ``inflight`` hashes, device → bytes held / leases held
- ``counts``   hash: ``seq``, ``admitted``, ``waiting_bytes``, ``rejected:<reason>``, ``failovers``, and
  ``bytes:<lane>`` / ``n:<lane>``, the bytes and waiters queued in each lane (for ``Retry-After``)
- ``released`` hash: the drain rate's decayed ``bytes`` and busy ``seconds``, ``last`` (ms), ``busy``
- ``boot``     hash: ``id`` of this Redis dataset (set when a script finds none), ``warm`` until when
  grants pause after a data loss, ``lost`` (ms) the time the lease clock has not counted, ``run``
  the run id of the Redis process that last ran a script on it (``counts``' ``failovers``: how
  often that changed)
- ``tenants``  set of the tenants that hold or wait; each has a hash ``tenants:<name>``: ``held``,
  ``inflight``, ``waiting``, ``wbytes`` (bytes waiting), ``vt``, ``served``, ``credit`` and
  ``hcredit`` (floats written with ``%.17g``, so they read back exactly), ``last`` (ms), ``low`` and
  ``high`` (the tenants ``credit`` and ``hcredit`` were measured against), and its admission rate's
  decayed ``abytes`` and ``asecs`` (seconds with a waiter) up to ``alast`` (ms). An idle tenant's hash expires after the
  ledger's ``tenant_idle_ttl`` (``PEXPIRE`` when it becomes idle, ``PERSIST`` when it is used again)
- ``holder``   hash, lease id → tenant

A request's ticket and its lease share one id, chosen by the client before the first call, so a
caller that gives up at any point can remove both with ``leave`` whatever the server did.
Admission runs inside the scripts with the in-process ledger's rule (docs/admission.md, "The
ledger"): ``dispatch`` looks only at lane heads, so its cost grows with the number of lanes, never
with the number of waiters. Each admitted ticket becomes a lease owned by its waiter and
``{id: device}`` is published on the wake channel, so a woken waiter needs no further round trip.
Time is the server's (``TIME``, in ``clock.lua``), so the hosts' clocks never matter. The fair
share between tenants (``fair_share``) is computed here with the same
arithmetic in the same order, so both ledgers reach the same floats and the same decisions.
Tenants' weights and quotas come with the config of every call: every process sharing a
namespace must configure the same tenants.

Leases and tickets expire by a *lease clock*: the server's time less what was lost in spells in
which no script ran at all (Redis stalled, or cut off from every worker, or restarted with its
data), beyond one heartbeat each. Every live worker beats once per heartbeat, so a longer spell
without scripts is one in which nobody could renew anything; it ages every lease as one heartbeat
would. A live holder renews within half a heartbeat of Redis serving again (after a beat that did
not land, the next comes half a heartbeat later: ``upkeep``), so between two of its renewals
a lease ages at most one heartbeat before the spell, one across it and half one after: 2.5
heartbeats of the 3 a default lease lasts. A crashed worker's lease still expires after
``lease_ttl`` of serving time. A gap of up to one heartbeat counts in full, so with scripts at
least once a heartbeat (any live worker) the lease clock keeps pace with the server's.

Data loss (Redis restarted without persistence, or flushed): a caller
that knew an earlier ``boot`` id sees a new one, so Redis lost what the workers still hold. Grants
then pause for ``warm`` (1.5 heartbeats) while every worker's heartbeat finds its leases missing
and puts them back (``restore``); requests queue meanwhile. A namespace used for the first time
has no earlier id to compare with and starts at once.

A failover (a replica promoted, by Sentinel, by hand or by a managed service) keeps the ``boot``
id, since the replica copied it, but can miss the last writes the old primary acknowledged:
replication is asynchronous. Every script compares the run id of the Redis process it runs on
(``INFO server``) with ``run``; another one (a promoted replica, or a restart from persistence
files, which can miss the last second of writes too) pauses grants exactly as a data loss does,
from the first script that runs there (docs/deployment.md, "Failover").
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.resources import files
from types import MappingProxyType

#: The scripts, each run as ``head.lua + clock.lua + prelude.lua + <name>.lua + epilogue.lua``.
NAMES = ("reserve", "claim", "leave", "release", "restore", "heartbeat")


def source(name: str) -> str:
    """The text of ``lua/<name>.lua`` in this package."""
    return files(__package__).joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


def compose(name: str, *, clock: str | None = None) -> str:
    """Script ``name``'s full text; ``clock`` replaces ``clock.lua`` (a test's variant: the
    production scripts never take one)."""
    parts = (source("head"), source("clock") if clock is None else clock, source("prelude"), source(name))
    return "".join(parts) + source("epilogue")


#: name -> text, composed once at import: the same bytes (and SHA) in every process.
SCRIPTS: Mapping[str, str] = MappingProxyType({name: compose(name) for name in NAMES})
