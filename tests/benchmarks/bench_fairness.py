"""Fair share between tenants on the simulated 24 GB GPU: one heavy tenant and four light ones.

    python -m tests.benchmarks.bench_fairness [--requests 4000] [--loads 2.0,4.0] [--seed 7]
                                              [--redis-requests 4000] [--time-scale 0.1]
                                              [--deadline-loads 2.0,4.0] [--deadline-seeds 8]
                                              [--redis-deadline-seeds N (default: --deadline-seeds)]

The device, model, cost model and request sizes are the overload benchmark's (``bench_overload``:
``Simulation``, ``Request``, ``workload``). Each request is drawn for the heavy tenant with
probability 10/14 and for each of the four light tenants with 1/14, so every tenant's arrivals are
Poisson with the same size distribution and the heavy tenant offers 10x each light one's load;
only the rate differs. "Heavy absent" replays the very same light requests without the heavy ones.

Fair share on: each request reserves for its tenant, all five with weight 1. Off (the baseline):
everyone is the one default tenant, so the ledger serves by arrival (and its bypass), not by tenant.

Measured, per ledger, load and fair share on/off:
- light tenants' p99 wait (admission - arrival) with the heavy tenant present and absent; a light
  request that is refused or times out counts as an infinite wait (it is not served at all);
- budget use while anyone waits: reserved / budget, time-weighted over the time the queue is non-empty;
- OOM: a request whose real allocation exceeds the device's free memory (as in bench_overload);
- while all five tenants have a request waiting: each tenant's share of the reserved bytes x
  seconds against its weight's share (0.2 each), and Jain's fairness index over share / weight
  (the verdict's measure). Beside it, fair share on (``_backlog``): those byte-seconds' part
  granted before each window opened, the heavy tenant's floor (its part of that over capacity x
  the windows' length: its share whatever is granted inside them), and the shares of the work
  (bytes x whole time held) granted while all five waited: the rule's own choices.

Deadlines (fair share on, the first max_queue): each client gives up after its own deadline,
uniform in [``--min-deadline``, ``--max-wait``] s (bench_overload's ``with_deadlines``). Off: every
request queues until then. On: the middleware's path (``try_reserve``, then ``reserve`` with the
client's ``wait_limit``, the tenant's): refused at once when the predicted wait is longer.
Goodput: requests (and tokens) served per offered second, both of all served and of those
finished by the last arrival; the verdict judges the latter, since a run that ends with a longer
queue goes on serving it after the arrivals stop.

Ledgers: the in-process ``Ledger`` in virtual time (deterministic; the deadline runs summed over
``--deadline-seeds`` arrival sequences), and the ``RedisLedger`` (a private redis-server) in real
time with every duration scaled by ``--time-scale`` (its heartbeat only in the deadline runs, unless
``--deadline-heartbeat default``, see ``redis_ledger``). Its deadline runs are summed over
``--redis-deadline-seeds`` arrival sequences, by default the in-process deadline runs' own (seeds
``--seed`` onward), so the verdict judges each ledger on its sum over the same sequences; the
in-process ledger on the first sequence alone is printed next to them, as earlier editions showed
it, and, when the Redis sequences are not the in-process ones, the in-process ledger summed over
the Redis ones. In real time one sequence costs about 1 minute at the two default loads (an
off+on pair at 4x is 15-30 s, at 2x about twice that), so the default 8 add about 7 minutes (the
whole command: 12 min on a quiet machine).
``Retry-After``'s 1 s floor is not scaled: in simulated seconds it is
1 / ``--time-scale``, so a deadline shorter than that is refused only when the predicted wait
exceeds the floor. The output ends with a verdict: each of issue 11's bars per ledger, met or not,
with its figure.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import math
import random
import statistics
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpu_asgi import (
    DEFAULT_TENANT,
    AnalyticEstimator,
    BudgetLedger,
    DeadlineUnmeetable,
    GPUAdmissionError,
    Ledger,
    QueueTimeout,
    TenantPolicy,
    budget_bytes,
)

from ._backlog import Grant, Tracker
from ._report import table, write_report
from .bench_overload import (
    DEVICE_BYTES,
    QWEN2_1_5B,
    RUNTIME_OVERHEAD,
    RUNTIME_OVERHEAD_REAL,
    WEIGHTS_BYTES,
    Request,
    Simulation,
    _pct,
    add_up,
    deadline_drop,
    with_deadlines,
    workload,
)

if TYPE_CHECKING:
    from gpu_asgi._ledger.redis.ledger import RedisLedger

HEAVY = "heavy"
LIGHTS = ("light-1", "light-2", "light-3", "light-4")
TENANTS = (HEAVY, *LIGHTS)
HEAVY_FACTOR = 10  # the heavy tenant's offered load over each light tenant's
REAL_FREE_BYTES = DEVICE_BYTES - WEIGHTS_BYTES - RUNTIME_OVERHEAD_REAL


@dataclass(slots=True)
class Arrival:
    tenant: str
    request: Request


def tenant_workload(n: int, seed: int, estimator: AnalyticEstimator, load: float, budget: int) -> list[Arrival]:
    """bench_overload's workload at ``load`` budgets of a *full* device, each request drawn for a
    tenant (heavy: 10/14).

    ``workload`` counts load with every request's service time on an idle device; on a full one a
    decode step is slower (``Simulation.duration`` grows with the sequences running), so its "2.5x"
    is several times more. Arrivals are spread by the factor the step grows by with as many
    average requests running as fit the budget (about 3.6x here), so ``load`` is the bytes x
    seconds the arrivals ask for over what a full device gives. Byte packing often runs more
    (smaller) requests than that, which slows every step further: the report's measured overload
    (offered over completed requests per second) is the figure to trust.
    """
    requests = workload(n, seed, estimator, load, budget)
    sim = Simulation(budget)
    idle = statistics.fmean(r.estimate * sim.duration(r) for r in requests)
    sim.running = round(budget / statistics.fmean(r.estimate for r in requests))  # as many as fit, on average
    stretch = statistics.fmean(r.estimate * sim.duration(r) for r in requests) / idle
    for r in requests:
        r.arrival *= stretch
    rng = random.Random(seed * 7919 + 1)  # a separate draw: the sizes and arrivals are the overload ones
    weights = [HEAVY_FACTOR] + [1] * len(LIGHTS)
    return [Arrival(rng.choices(TENANTS, weights)[0], r) for r in requests]


def fresh(arrivals: Sequence[Arrival], heavy: bool) -> list[Arrival]:
    """A copy to run (requests carry their outcome), with or without the heavy tenant's requests."""
    return [
        Arrival(a.tenant, Request(a.request.arrival, a.request.prompt_tokens, a.request.max_new_tokens,
                                  a.request.new_tokens, a.request.deadline, a.request.estimate, a.request.actual))
        for a in arrivals
        if heavy or a.tenant != HEAVY
    ]


@dataclass(frozen=True)
class Queues:
    """The ledger's ``max_queue`` and, with fair share on, each tenant's own bound (``TenantPolicy.max_queue``)."""

    total: int
    per_tenant: int | None = None

    @classmethod
    def parse(cls, text: str) -> Queues:
        """``"256"`` or ``"256/64"`` (64 per tenant)."""
        total, _, per_tenant = text.partition("/")
        return cls(int(total), int(per_tenant) if per_tenant else None)

    def __str__(self) -> str:
        return str(self.total) if self.per_tenant is None else f"{self.total} ({self.per_tenant} per tenant)"

    def tenants(self, fair: bool) -> dict[str, TenantPolicy] | None:
        """Every tenant at weight 1 (fair share on), or None: everyone the one default tenant."""
        return {t: TenantPolicy(max_queue=self.per_tenant) for t in TENANTS} if fair else None


def make_ledger(budget: int, fair: bool, queues: Queues, clock: Callable[[], float]) -> Ledger:
    return Ledger(budget, max_queue=queues.total, max_wait=1e9, tenants=queues.tenants(fair), clock=clock)


def simulate(
    arrivals: list[Arrival], budget: int, fair: bool, max_queue: Queues, max_wait: float, deadline_aware: bool = False
) -> dict[str, Any]:
    """The in-process ledger in virtual time (bench_overload's event loop: heap + a spun asyncio loop).

    Each client gives up after ``min(max_wait, its deadline)``; ``deadline_aware`` takes the
    middleware's path (``try_reserve``, then ``reserve`` with the deadline as ``wait_limit``):
    refused at once when the predicted wait is longer than the deadline."""
    loop = asyncio.new_event_loop()
    sim = Simulation(budget)
    ledger = make_ledger(budget, fair, max_queue, lambda: sim.now)
    present = tuple(sorted({a.tenant for a in arrivals}, key=TENANTS.index))
    tracker = Tracker(budget, present, lambda: sim.now, running=lambda: sim.running)
    tasks: dict[int, asyncio.Task[None]] = {}

    def spin() -> None:
        async def idle() -> None:
            for _ in range(8):
                await asyncio.sleep(0)
        loop.run_until_complete(idle())

    def finish(a: Arrival, granted: Grant, release: Callable[[], object]) -> None:
        r = a.request
        sim.allocated -= r.actual
        sim.running -= 1
        r.finished, r.outcome = sim.now, "ok"
        tracker.release(granted)
        release()
        spin()

    async def admit(a: Arrival) -> None:
        r = a.request
        tenant = a.tenant if fair else DEFAULT_TENANT
        reservation = ledger.try_reserve(r.estimate, tenant=tenant) if deadline_aware else None
        if reservation is None:  # queue: the client's own timeout event (``timeout`` below) cancels the wait
            # What the decision in reserve() sees: the same state, nothing runs in between. Kept
            # for a request that then times out in the queue too (bench_deadline_mix reads it).
            r.predicted = ledger.retry_after(r.estimate, tenant=tenant) if deadline_aware else None
            tracker.wait(a.tenant, 1)
            try:
                reservation = await ledger.reserve(r.estimate, tenant=tenant, wait_limit=r.deadline if deadline_aware else None)
            except BaseException as error:
                tracker.wait(a.tenant, -1)
                if isinstance(error, DeadlineUnmeetable):
                    r.outcome, r.predicted = "unmeetable", error.retry_after  # the prediction that refused it
                elif isinstance(error, GPUAdmissionError):
                    r.outcome = "rejected"
                else:
                    raise  # the client gave up (``timeout`` cancels the task)
                return
            granted = tracker.grant(a.tenant, r.estimate)
        else:
            granted = tracker.grant(a.tenant, r.estimate, waited=False)
        r.admitted = sim.now
        if sim.allocated + r.actual > REAL_FREE_BYTES:
            r.outcome, tracker.oom = "oom", tracker.oom + 1
            tracker.release(granted)
            reservation.release()
            return
        sim.allocated += r.actual
        sim.running += 1
        sim.at(sim.now + sim.duration(r), lambda: finish(a, granted, reservation.release))

    def arrive(index: int, a: Arrival) -> None:
        tasks[index] = loop.create_task(admit(a))
        spin()
        sim.at(a.request.arrival + min(max_wait, a.request.deadline), lambda: timeout(index, a))

    def timeout(index: int, a: Arrival) -> None:
        if a.request.admitted is None and a.request.outcome == "pending":
            a.request.outcome = "timeout"
            tasks[index].cancel()
            spin()

    for index, a in enumerate(arrivals):
        sim.at(a.request.arrival, lambda index=index, a=a: arrive(index, a))
    while sim.events:
        sim.now, _, action = heapq.heappop(sim.events)
        action()
    loop.close()
    return summarize(arrivals, tracker)


async def run_realtime(
    ledger: BudgetLedger, arrivals: list[Arrival], budget: int, fair: bool, max_wait: float, scale: float,
    deadline_aware: bool = False,
) -> dict[str, Any]:
    """Any ledger in real time: each request a task that sleeps to its arrival, reserves, holds
    for its (scaled) service time and releases. Times are reported in unscaled seconds.

    As ``simulate``: each client waits at most ``min(max_wait, its deadline)``, and
    ``deadline_aware`` takes the middleware's path (on the scaled deadline: the ledger's
    predictions are in real seconds)."""
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.2  # room to create the tasks before the first arrival

    def clock() -> float:
        return (loop.time() - start) / scale

    sim = Simulation(budget)  # only for its cost model: allocated, running, duration()
    present = tuple(sorted({a.tenant for a in arrivals}, key=TENANTS.index))
    tracker = Tracker(budget, present, clock, running=lambda: sim.running)
    predictions = predicted_waits(ledger) if deadline_aware else {}

    async def one(a: Arrival) -> None:
        r = a.request
        await asyncio.sleep(max(0.0, start + r.arrival * scale - loop.time()))
        tenant = a.tenant if fair else DEFAULT_TENANT
        timeout, wait_limit = min(max_wait, r.deadline) * scale, r.deadline * scale if deadline_aware else None
        reservation = ledger.try_reserve(r.estimate, tenant=tenant) if deadline_aware else None
        tracker.wait(a.tenant, 1)
        try:
            if reservation is None:
                reservation = await ledger.reserve(r.estimate, tenant=tenant, timeout=timeout, wait_limit=wait_limit)
                if deadline_aware:
                    r.predicted = predictions.pop(asyncio.current_task(), 0.0) / scale
        except BaseException as error:
            tracker.wait(a.tenant, -1)
            if isinstance(error, DeadlineUnmeetable):
                r.outcome = "unmeetable"
            elif isinstance(error, QueueTimeout):
                r.outcome = "timeout"
            elif isinstance(error, GPUAdmissionError):
                r.outcome = "rejected"
            else:
                raise
            return
        granted = tracker.grant(a.tenant, r.estimate)
        r.admitted = clock()
        try:
            if sim.allocated + r.actual > REAL_FREE_BYTES:
                r.outcome, tracker.oom = "oom", tracker.oom + 1
                return
            sim.allocated += r.actual
            sim.running += 1
            try:
                await asyncio.sleep(sim.duration(r) * scale)
            finally:
                sim.allocated -= r.actual
                sim.running -= 1
            r.finished, r.outcome = clock(), "ok"
        finally:
            tracker.release(granted)
            reservation.release()

    await asyncio.gather(*(one(a) for a in arrivals))
    tracker.advance()
    return summarize(arrivals, tracker)


def predicted_waits(ledger: BudgetLedger) -> dict[asyncio.Task[Any] | None, float]:
    """The predicted wait each queued request's deadline decision saw, by the task that awaited
    ``reserve`` (filled as ``reserve`` decides). The in-process ledger decides on its own state,
    which ``retry_after`` reads just as well; the Redis ledger on a snapshot its reserve script
    returns, which only the decision sees, so a spy on that decision reads it."""
    predictions: dict[asyncio.Task[Any] | None, float] = {}
    decide = ledger._refuse_unmeetable  # type: ignore[attr-defined]  # both ledgers' one decision (_ledger.base)

    def spy(limit: float | None, release_rate: float, predict: Callable[[], float]) -> None:
        predictions[asyncio.current_task()] = predict()  # the prediction it decides on (the quota included)
        decide(limit, release_rate, predict)

    ledger._refuse_unmeetable = spy  # type: ignore[attr-defined]
    return predictions


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all values are equal, 1/n when one has everything."""
    total, squares = sum(values), sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else float("nan")


def prediction_error(arrivals: list[Arrival]) -> dict[str, float]:
    """How good the deadline decision's prediction was: the median of the real wait over the
    predicted one, for the requests that queued and were admitted, heavy tenant and lights apart."""
    ratios: dict[str, list[float]] = {"heavy": [], "lights": []}
    for a in arrivals:
        r = a.request
        if r.predicted and r.admitted is not None:
            ratios["heavy" if a.tenant == HEAVY else "lights"].append((r.admitted - r.arrival) / r.predicted)
    return {group: statistics.median(values) for group, values in ratios.items() if values}


def summarize(arrivals: list[Arrival], tracker: Tracker) -> dict[str, Any]:
    lights = [a.request for a in arrivals if a.tenant != HEAVY]
    waits = sorted(math.inf if r.admitted is None else r.admitted - r.arrival for r in lights)
    outcomes = {o: sum(a.request.outcome == o for a in arrivals) for o in ("ok", "oom", "rejected", "unmeetable", "timeout")}
    done = [a.request for a in arrivals if a.request.outcome == "ok"]
    first = min(a.request.arrival for a in arrivals)
    last = max(a.request.arrival for a in arrivals)
    offered = last - first
    offered_rate = len(arrivals) / offered
    served_rate = len(done) / (max(r.finished for r in done) - first) if done else 0.0  # type: ignore[type-var]
    result: dict[str, Any] = {
        **outcomes,
        "heavy_timeouts": sum(a.tenant == HEAVY and a.request.outcome == "timeout" for a in arrivals),
        "wait_over_predicted": prediction_error(arrivals),
        "offered_seconds": offered,
        "tokens": sum(r.new_tokens for r in done),
        # Served while requests still arrive: a run that ends with a longer queue (30 s of work with
        # deadlines off) goes on serving it after the last arrival, which is no goodput per second.
        "ok_in_window": sum(r.finished <= last for r in done),  # type: ignore[operator]
        "tokens_in_window": sum(r.new_tokens for r in done if r.finished <= last),  # type: ignore[operator]
        "offered_over_served": offered_rate / served_rate if served_rate else math.inf,
        "light_requests": len(lights),
        "light_not_admitted": sum(r.admitted is None for r in lights),
        "light_p99_wait_s": _pct(waits, 99),
        "light_p50_wait_s": _pct(waits, 50),
        "budget_use_while_waiting": tracker.busy_area / tracker.busy_time if tracker.busy_time else None,
        "mean_running_while_waiting": tracker.running_area / tracker.busy_time if tracker.busy_time else None,
        "oom_count": tracker.oom,
        "all_backlogged_s": tracker.backlog_time,
    }
    total = sum(tracker.backlog_byte_seconds.values())
    if len(tracker.tenants) == len(TENANTS) and total > 0:
        shares = {t: tracker.backlog_byte_seconds[t] / total for t in TENANTS}
        weight = 1 / len(TENANTS)  # equal weights
        result["shares"] = shares
        result["jain"] = jain([s / weight for s in shares.values()])
        result.update(backlog_split(tracker))
    return result


def backlog_split(tracker: Tracker) -> dict[str, Any]:
    """The bar's byte-seconds split by when they were granted (``_backlog``), as shares of the
    windows' total, the shares of the work granted inside the windows, and the floor under the
    heavy tenant's share that no choice made inside the windows can lower."""
    total = sum(tracker.backlog_byte_seconds.values())
    granted = sum(tracker.granted_work.values())
    weight = 1 / len(TENANTS)
    split: dict[str, Any] = {
        "windows": sum(closed is None or closed > opened for opened, closed in tracker.windows),
        "inherited_shares": {t: tracker.inherited_byte_seconds[t] / total for t in TENANTS},
        "inside_shares": {t: tracker.inside_byte_seconds[t] / total for t in TENANTS},
        # Held before a window opened, the heavy tenant's bytes count in it whatever is granted
        # there; the windows can hold at most capacity x their length.
        "heavy_floor": tracker.inherited_byte_seconds[HEAVY] / (tracker.capacity * tracker.backlog_time),
    }
    if granted > 0:
        split["granted_shares"] = shares = {t: tracker.granted_work[t] / granted for t in TENANTS}
        split["granted_jain"] = jain([s / weight for s in shares.values()])
    return split


def ratio(present: float, absent: float) -> float:
    if math.isinf(present):
        return math.inf
    return present / absent if absent > 0 else (1.0 if present == 0 else math.inf)


def row(
    ledger: str, load: float, max_queue: Queues, fair: bool, present: dict[str, Any], absent: dict[str, Any]
) -> list[Any]:
    shares = present.get("shares")
    use = present["budget_use_while_waiting"]
    return [
        ledger, f"{load:g}x", f"{present['offered_over_served']:.1f}x", str(max_queue) if fair else max_queue.total,
        "on" if fair else "off (one tenant)",
        present["light_p99_wait_s"], absent["light_p99_wait_s"],
        ratio(present["light_p99_wait_s"], absent["light_p99_wait_s"]),
        f"{present['light_not_admitted']}/{present['light_requests']}",
        "-" if use is None else f"{use:.1%}",
        present["oom_count"],
        present["all_backlogged_s"],
        "-" if shares is None else f"{shares[HEAVY]:.2f} / " + " ".join(f"{shares[t]:.2f}" for t in LIGHTS),
        present.get("jain", float("nan")),
    ]


HEADER = [
    "ledger", "load", "offered / served req/s", "max_queue", "fair share", "light p99 wait s (heavy present)", "light p99 wait s (heavy absent)",
    "ratio (bar <= 1.5)", "lights not admitted", "budget use while waiting (bar >= 90%)", "OOM",
    "all backlogged s", "byte-s shares heavy / lights (weights 0.2 each)", "Jain (bar >= 0.95)",
]


def split_row(ledger: str, load: float, max_queue: Queues, result: dict[str, Any]) -> list[Any]:
    """Where a fair-share run's backlogged byte-seconds come from (``backlog_split``)."""
    def tenants(shares: dict[str, float]) -> str:
        return f"{shares[HEAVY]:.3f} / " + " ".join(f"{shares[t]:.3f}" for t in LIGHTS)

    granted = result.get("granted_shares")
    return [
        ledger, f"{load:g}x", str(max_queue), result["all_backlogged_s"], result["windows"], tenants(result["shares"]),
        result["jain"], tenants(result["inherited_shares"]), result["heavy_floor"],
        "-" if granted is None else tenants(granted), result.get("granted_jain", float("nan")),
    ]


SPLIT_HEADER = [
    "ledger", "load", "max_queue", "all backlogged s", "windows", "the bar's byte-s shares heavy / lights",
    "Jain (the bar's)", "of which granted before the window opened", "heavy floor: its inherited byte-s / capacity x time",
    "work granted in the windows: shares heavy / lights", "its Jain",
]


def redis_ledger(
    url: str, budget: int, fair: bool, max_queue: Queues, max_wait: float, scale: float, scaled_heartbeat: bool = False
) -> RedisLedger:
    """A fresh namespace on the private server.

    ``scaled_heartbeat``: the heartbeat, i.e. the age of the snapshot behind ``retry_after`` (the
    ``Retry-After`` of a timeout; the deadline decision reads the reserve script's state, never
    the snapshot), scaled like every other duration. It also bounds the waiters' fallback poll,
    so every waiter then asks Redis ``1 / scale`` times as often: the fair-share runs, with over a
    thousand waiters, keep the default (fair share is decided in Redis, not from the snapshot).
    """
    from gpu_asgi._ledger.redis.ledger import DEFAULT_LEASE_TTL, RedisLedger  # the redis extra

    heartbeat = DEFAULT_LEASE_TTL / 3 * (scale if scaled_heartbeat else 1)
    return RedisLedger(url, budget, namespace=f"fair-{uuid.uuid4().hex[:8]}", max_queue=max_queue.total,
                       max_wait=max_wait * scale, heartbeat=heartbeat, tenants=max_queue.tenants(fair))


async def redis_runs(
    url: str, arrivals: list[Arrival], budget: int, max_queue: Queues, max_wait: float, scale: float
) -> dict[tuple[bool, bool], dict[str, Any]]:
    """Fair share on and off, heavy tenant present and absent: results by (fair, heavy)."""
    runs = {}
    for fair in (True, False):
        for heavy in (True, False):
            ledger = redis_ledger(url, budget, fair, max_queue, max_wait, scale)
            try:
                runs[fair, heavy] = await run_realtime(ledger, fresh(arrivals, heavy), budget, fair, max_wait, scale)
            finally:
                await ledger.aclose()
    return runs


async def redis_deadline_runs(
    url: str, arrivals: list[Arrival], budget: int, max_queue: Queues, max_wait: float, scale: float,
    scaled_heartbeat: bool = True,
) -> dict[bool, dict[str, Any]]:
    """Deadlines off and on (fair share on, heavy tenant present): results by ``deadline_aware``."""
    runs = {}
    for deadline_aware in (False, True):
        ledger = redis_ledger(url, budget, True, max_queue, max_wait, scale, scaled_heartbeat=scaled_heartbeat)
        try:
            runs[deadline_aware] = await run_realtime(
                ledger, fresh(arrivals, True), budget, True, max_wait, scale, deadline_aware
            )
        finally:
            await ledger.aclose()
    return runs


def clients(requests: int, seed: int, estimator: AnalyticEstimator, load: float, budget: int, min_deadline: float,
            max_wait: float) -> list[Arrival]:
    """``tenant_workload``'s arrivals, each client with its deadline (bench_overload's ``with_deadlines``)."""
    arrivals = tenant_workload(requests, seed, estimator, load, budget)
    timed = with_deadlines([a.request for a in arrivals], seed, min_deadline, max_wait)
    return [Arrival(a.tenant, r) for a, r in zip(arrivals, timed, strict=True)]


def deadline_row(ledger: str, load: float, runs: str, result: dict[str, Any]) -> list[Any]:
    return [
        ledger, f"{load:g}x", runs, "on" if result["policy"] == "deadlines-on" else "off", result["ok"], result["rejected"],
        result["unmeetable"], result["timeout"], f"{result['heavy_timeouts']} / {result['timeout'] - result['heavy_timeouts']}",
        result["oom"], result["goodput_rps_offered"], result["goodput_tokens_per_s_offered"],
        result["ok_in_window"] / result["offered_seconds"], result["tokens_in_window"] / result["offered_seconds"],
        " / ".join(f"{error[group]:.2f}" if group in error else "-" for group in ("heavy", "lights"))
        if (error := result["wait_over_predicted"]) else "-",
    ]


DEADLINE_HEADER = [
    "ledger", "load", "runs", "deadline-aware admission", "ok", "rejected (queue full)", "refused: deadline", "timed out",
    "timed out heavy / lights", "OOM", "goodput req/s (offered)", "tokens/s (offered)",
    "goodput req/s (served by the last arrival)", "tokens/s (served by the last arrival)",
    "queued: median wait / predicted, heavy / lights",
]


def deadline_totals(name: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """``add_up`` plus how many of the timeouts are the heavy tenant's."""
    total = {**add_up(name, results), "heavy_timeouts": sum(result["heavy_timeouts"] for result in results)}
    for key in ("ok_in_window", "tokens_in_window"):
        total[key] = sum(result[key] for result in results)
    total["wait_over_predicted"] = {  # the median over the runs' medians
        group: statistics.median(values)
        for group in ("heavy", "lights")
        if (values := [result["wait_over_predicted"][group] for result in results if group in result["wait_over_predicted"]])
    }
    return total


def run_deadlines(arrival_sets: list[list[Arrival]], budget: int, max_queue: Queues, max_wait: float) -> dict[bool, dict[str, Any]]:
    """Deadlines off and on in virtual time on each arrival sequence, summed."""
    totals = {}
    for deadline_aware in (False, True):
        results = [simulate(fresh(arrivals, True), budget, True, max_queue, max_wait, deadline_aware) for arrivals in arrival_sets]
        totals[deadline_aware] = deadline_totals(f"deadlines-{'on' if deadline_aware else 'off'}", results)
    return totals


def check(value: float, met: bool, text: str) -> str:
    return f"{'met' if met else 'NOT met'}: {text.format(value)}"


def verdict(fairness: dict[tuple[str, float], dict[tuple[bool, bool], dict[str, Any]]],
            deadlines: dict[tuple[str, float], dict[bool, dict[str, Any]]], oom: dict[str, int]) -> list[list[str]]:
    """Issue 11's bars, per ledger and load, from this run's results (fair share on); ``oom``: the
    OOM count of every run, by ledger."""
    ledgers = list(oom)
    rows: list[list[str]] = []
    loads = sorted({load for _, load in fairness} | {load for _, load in deadlines})
    weight = 1 / len(TENANTS)

    def cell(ledger: str, load: float, judge: Callable[[dict[tuple[bool, bool], dict[str, Any]]], str]) -> str:
        runs = fairness.get((ledger, load))
        return judge(runs) if runs else "-"

    def light_p99(runs: dict[tuple[bool, bool], dict[str, Any]]) -> str:
        present, absent = runs[True, True]["light_p99_wait_s"], runs[True, False]["light_p99_wait_s"]
        value = ratio(present, absent)
        shown = "{:.3g}x" if math.isfinite(value) else "unbounded"
        return check(value, value <= 1.5, f"{shown} ({present:.3g} s against {absent:.3g} s)")

    def budget_use(runs: dict[tuple[bool, bool], dict[str, Any]]) -> str:
        use = runs[True, True]["budget_use_while_waiting"]
        return "-" if use is None else check(use, use >= 0.9, "{:.1%}")

    def shares(runs: dict[tuple[bool, bool], dict[str, Any]]) -> str:
        result = runs[True, True]
        if "shares" not in result:
            return "not measured: never all five backlogged"
        worst = max(result["shares"].values(), key=lambda s: abs(s / weight - 1))
        off = worst / weight - 1
        text = f"worst share {worst:.3f} ({{:+.1%}}) over {result['all_backlogged_s']:.1f} s backlogged"
        if "heavy_floor" in result:  # the heavy tenant's share no choice made inside the windows can lower
            text += f"; heavy floor {result['heavy_floor']:.3f} (granted before the windows opened)"
        return check(off, abs(off) <= 0.1, text)

    def jain_index(runs: dict[tuple[bool, bool], dict[str, Any]]) -> str:
        value = runs[True, True].get("jain")
        return "not measured: never all five backlogged" if value is None else check(value, value >= 0.95, "{:.3f}")

    for bar, judge in (
        ("light p99 wait <= 1.5x heavy absent", light_p99),
        ("budget use while waiting >= 90%", budget_use),
        ("byte-s shares within 10% of weights", shares),
        ("Jain's index >= 0.95", jain_index),
    ):
        rows += [[bar, f"{load:g}x", *(cell(ledger, load, judge) for ledger in ledgers)] for load in loads]
    rows.append(["0 OOM (every run above)", "all", *(check(oom[ledger], oom[ledger] == 0, "{} OOM") for ledger in ledgers)])
    for load in loads:
        cells = []
        for ledger in ledgers:
            runs = deadlines.get((ledger, load))
            if runs is None:
                cells.append("-")
                continue
            change = deadline_drop(runs[False], runs[True])
            off, on = runs[False], runs[True]
            # NaN when deadlines off served nothing by the last arrival (a tiny run on a loaded machine), as
            # deadline_drop does: not met, and no ZeroDivisionError in the verdict.
            window = tuple(on[key] / off[key] - 1 if off[key] else math.nan for key in ("ok_in_window", "tokens_in_window"))
            met = change["timeout_drop"] >= 0.8 and min(window) >= 0
            cells.append(check(change["timeout_drop"], met, f"{{:.1%}} fewer timeouts ({off['timeout']} -> "
                               f"{on['timeout']}), goodput served by the last arrival {window[0]:+.1%} requests, "
                               f"{window[1]:+.1%} tokens (all served: {change['goodput_change']:+.1%}, "
                               f"{change['tokens_change']:+.1%})"))
        rows.append(["timeouts >= 80% fewer with deadlines on, equal or better goodput (served by the last arrival)",
                     f"{load:g}x", *cells])
    return rows


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000, help="requests per in-process run")
    parser.add_argument("--loads", default="2.0,4.0", help="total offered loads in budgets (>= 2), comma-separated")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--max-queues", default="4096,256,256/64",
                        help="ledger max_queue values, comma-separated; 256/64: also 64 per tenant (fair share on); "
                             "the first is the Redis runs', the deadline runs' and the verdict's")
    parser.add_argument("--max-wait", type=float, default=30.0)
    parser.add_argument("--redis-requests", type=int, default=4000, help="requests per RedisLedger run (0: skip Redis)")
    parser.add_argument("--redis-loads", default="2.0,4.0", help="loads for the RedisLedger runs")
    parser.add_argument("--time-scale", type=float, default=0.1, help="real seconds per simulated second (Redis runs)")
    parser.add_argument("--deadline-loads", default="2.0,4.0", help="loads for the deadline runs (empty: none)")
    parser.add_argument("--min-deadline", type=float, default=2.0, help="shortest client deadline; the longest is --max-wait")
    parser.add_argument("--deadline-seeds", type=int, default=8, help="arrival sequences per in-process deadline run, summed")
    parser.add_argument("--redis-deadline-seeds", type=int, default=None,
                        help="arrival sequences per RedisLedger deadline run, summed (default: --deadline-seeds, "
                             "the in-process runs' sequences; about 1 min of real time per sequence at the two loads)")
    parser.add_argument("--deadline-heartbeat", choices=("scaled", "default"), default="scaled",
                        help="the Redis deadline runs' heartbeat: scaled by --time-scale, or the ledger's default")
    args = parser.parse_args()
    if args.redis_deadline_seeds is None:
        args.redis_deadline_seeds = args.deadline_seeds
    estimator = AnalyticEstimator.from_config(QWEN2_1_5B)
    budget = budget_bytes(DEVICE_BYTES, utilization=0.90, weights_bytes=WEIGHTS_BYTES, runtime_overhead_bytes=RUNTIME_OVERHEAD)
    rows: list[list[Any]] = []
    split_rows: list[list[Any]] = []  # fair share on, all five backlogged at some time
    results: list[dict[str, Any]] = []
    queues = [Queues.parse(x) for x in args.max_queues.split(",")]
    memory, redis = "Ledger (virtual time)", f"RedisLedger (real time x{args.time_scale:g})"
    fairness: dict[tuple[str, float], dict[tuple[bool, bool], dict[str, Any]]] = {}  # for the verdict

    def in_process(arrivals: list[Arrival], load: float, max_queue: Queues, fairs: Sequence[bool], label: str) -> None:
        for fair in fairs:
            present = simulate(fresh(arrivals, True), budget, fair, max_queue, args.max_wait)
            absent = simulate(fresh(arrivals, False), budget, fair, max_queue, args.max_wait)
            rows.append(row(label, load, max_queue, fair, present, absent))
            if fair and "shares" in present:
                split_rows.append(split_row(label, load, max_queue, present))
            results.append({"ledger": "memory", "requests": len(arrivals), "load": load, "max_queue": str(max_queue),
                            "fair": fair, "present": present, "absent": absent})
            if fair and max_queue == queues[0]:
                fairness[label, load] = {(True, True): present, (True, False): absent}

    for max_queue in queues:
        for load in floats(args.loads):
            arrivals = tenant_workload(args.requests, args.seed, estimator, load, budget)
            # A per-tenant bound means nothing with one tenant: its "off" row is the plain max_queue's.
            in_process(arrivals, load, max_queue, (True, False) if max_queue.per_tenant is None else (True,), memory)
    deadline_rows: list[list[Any]] = []
    deadlines: dict[tuple[str, float], dict[bool, dict[str, Any]]] = {}
    seeds = range(args.seed, args.seed + args.deadline_seeds)
    for load in floats(args.deadline_loads):
        totals = run_deadlines([clients(args.requests, s, estimator, load, budget, args.min_deadline, args.max_wait)
                                for s in seeds], budget, queues[0], args.max_wait)
        deadlines[memory, load] = totals
        sequences = f"seeds {seeds.start}-{seeds.stop - 1}, {args.requests} each"
        deadline_rows += [deadline_row(memory, load, sequences, t) for t in totals.values()]
        results.append({"ledger": "memory", "deadlines": True, "requests": args.requests, "seeds": list(seeds), "load": load,
                        "max_queue": str(queues[0]), "off": totals[False], "on": totals[True]})
    ledgers = [memory]
    if args.redis_requests:
        from tests._redis import RedisServer

        ledgers.append(redis)
        server = RedisServer().start()
        try:
            for load in floats(args.redis_loads):
                arrivals = tenant_workload(args.redis_requests, args.seed, estimator, load, budget)
                if args.redis_requests != args.requests or load not in floats(args.loads):
                    # the in-process ledger on the very same requests, in virtual time
                    in_process(arrivals, load, queues[0], (True, False), f"Ledger (virtual time, {len(arrivals)} requests)")
                runs = asyncio.run(redis_runs(server.url, arrivals, budget, queues[0], args.max_wait, args.time_scale))
                fairness[redis, load] = {key: run for key, run in runs.items() if key[0]}
                for fair in (True, False):
                    rows.append(row(redis, load, queues[0], fair, runs[fair, True], runs[fair, False]))
                if "shares" in runs[True, True]:
                    split_rows.append(split_row(redis, load, queues[0], runs[True, True]))
                    results.append({"ledger": "redis", "requests": len(arrivals), "load": load, "max_queue": str(queues[0]),
                                    "fair": fair, "present": runs[fair, True], "absent": runs[fair, False]})
            redis_seeds = range(args.seed, args.seed + args.redis_deadline_seeds)
            for load in floats(args.deadline_loads):
                sets = [clients(args.redis_requests, s, estimator, load, budget, args.min_deadline, args.max_wait)
                        for s in redis_seeds]
                # The in-process ledger on the first sequence, as earlier editions showed it next to Redis.
                first = f"seed {args.seed}, {args.redis_requests}"
                side = run_deadlines(sets[:1], budget, queues[0], args.max_wait)
                deadline_rows += [deadline_row(memory, load, first, t) for t in side.values()]
                results.append({"ledger": "memory", "deadlines": True, "requests": args.redis_requests,
                                "seeds": [args.seed], "load": load, "max_queue": str(queues[0]),
                                "off": side[False], "on": side[True]})
                sequences = (f"seeds {redis_seeds.start}-{redis_seeds.stop - 1}, {args.redis_requests} each"
                             if len(redis_seeds) > 1 else first)
                if (args.redis_requests, redis_seeds) != (args.requests, seeds) and len(redis_seeds) > 1:
                    # the in-process ledger summed over the very same sequences as Redis below
                    twin = run_deadlines(sets, budget, queues[0], args.max_wait)
                    deadline_rows += [deadline_row(memory, load, sequences, t) for t in twin.values()]
                    results.append({"ledger": "memory", "deadlines": True, "requests": args.redis_requests,
                                    "seeds": list(redis_seeds), "load": load, "max_queue": str(queues[0]),
                                    "off": twin[False], "on": twin[True]})
                timed = [asyncio.run(redis_deadline_runs(server.url, arrivals, budget, queues[0], args.max_wait,
                                                         args.time_scale, args.deadline_heartbeat == "scaled"))
                         for arrivals in sets]
                totals = {aware: deadline_totals(f"deadlines-{'on' if aware else 'off'}", [run[aware] for run in timed])
                          for aware in (False, True)}
                deadlines[redis, load] = totals
                deadline_rows += [deadline_row(redis, load, sequences, t) for t in totals.values()]
                results.append({"ledger": "redis", "deadlines": True, "requests": args.redis_requests,
                                "seeds": list(redis_seeds), "load": load, "max_queue": str(queues[0]),
                                "off": totals[False], "on": totals[True]})
        finally:
            server.stop()
    print(f"budget {budget / (1 << 30):.2f} GiB; heavy tenant {HEAVY_FACTOR}x each of {len(LIGHTS)} light tenants")
    print(table(rows, HEADER))
    if split_rows:
        print("\nfair share on: the windows in which all five wait, their byte-s split by when they were granted "
              "(granted before a window opened, no admission can take back)")
        print(table(split_rows, SPLIT_HEADER))
    if deadline_rows:
        print(f"\nclient deadlines uniform in [{args.min_deadline:g}, {args.max_wait:g}] s, fair share on, "
              f"max_queue {queues[0]}; several seeds: summed; goodput per second of offered time")
        print(table(deadline_rows, DEADLINE_HEADER))
    oom = dict.fromkeys(ledgers, 0)
    for entry in results:  # every run of this command, the side-by-side ones under the in-process ledger
        oom[memory if entry["ledger"] == "memory" else redis] += sum(
            entry[run]["oom"] for run in ("present", "absent", "off", "on") if run in entry
        )
    checks = verdict(fairness, deadlines, oom)
    print(f"\nverdict: issue 11's bars, fair share on, max_queue {queues[0]}, from the runs above")
    print(table(checks, ["bar", "load", *ledgers]))
    print("report:", write_report("fairness", {"args": vars(args), "budget_bytes": budget, "results": results,
                                               "verdict": checks}))


if __name__ == "__main__":
    main()
