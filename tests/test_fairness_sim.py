"""The fairness simulation behind docs/benchmarks.md ("Fair share between tenants"), small: with
fair share on, the heavy tenant gets its weight's share of the byte-seconds while all tenants are
backlogged; with everyone one tenant (the baseline) it gets most of them; with deadline-aware
admission, fewer requests time out in the queue."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from gpu_asgi import AnalyticEstimator, TenantPolicy, budget_bytes
from tests import _redis
from tests._redis import RedisServer, eventually, requires_redis_server
from tests.benchmarks._backlog import Tracker
from tests.benchmarks.bench_fairness import (
    HEAVY,
    LIGHTS,
    TENANTS,
    Queues,
    backlog_split,
    clients,
    fresh,
    jain,
    main,
    predicted_waits,
    simulate,
    tenant_workload,
    verdict,
)
from tests.benchmarks.bench_overload import DEVICE_BYTES, QWEN2_1_5B, RUNTIME_OVERHEAD, WEIGHTS_BYTES

redis_server, namespace = _redis.redis_server, _redis.namespace  # fixtures


def test_jain_index() -> None:
    assert jain([1.0, 1.0, 1.0]) == 1.0
    assert jain([1.0, 0.0, 0.0, 0.0]) == 0.25


def test_backlogged_byte_seconds_split_by_when_they_were_granted() -> None:
    """A hand-made timeline, capacity 100, the heavy tenant and light-1 holding, the other three
    lights waiting throughout; all five wait in [1, 2] and [3, 6] (two windows).

    t=0  heavy: 3 waiters, g1 = 60 bytes granted to one     t=4  release g1; g3 = 50 granted to heavy
    t=1  light-1 waits: window 1 opens                      t=5  release g2
    t=2  g2 = 30 to light-1's waiter: window 1 closes       t=6  g4 = 20 to light-1's waiter: window 2 closes
    t=3  light-1 waits: window 2 opens                      t=8  release g3; t=9 release g4

    By hand, in the windows (4 s): heavy holds 60 in [1, 2] and [3, 4] (g1, granted before either
    opened: inherited 120) and 50 in [4, 6] (g3, inside: 100); light-1 holds g2 in [3, 5] (granted
    in window 1, so inherited in window 2: 60) and nothing after. Work granted while all five
    waited: g3 50 x 4 s = 200 for heavy; g2 30 x 3 s + g4 20 x 3 s = 150 for light-1 (a grant that
    closes a window was made in it). Heavy's floor: 120 / (100 x 4 s) = 0.3."""
    now = 0.0
    tracker = Tracker(100, TENANTS, lambda: now)
    light = LIGHTS[0]
    for other in LIGHTS[1:]:
        tracker.wait(other, 1)
    for _ in range(3):
        tracker.wait(HEAVY, 1)
    g1 = tracker.grant(HEAVY, 60)
    now = 1.0
    tracker.wait(light, 1)
    now = 2.0
    g2 = tracker.grant(light, 30)
    now = 3.0
    tracker.wait(light, 1)
    now = 4.0
    tracker.release(g1)
    g3 = tracker.grant(HEAVY, 50)
    now = 5.0
    tracker.release(g2)
    now = 6.0
    g4 = tracker.grant(light, 20)
    now = 8.0
    tracker.release(g3)
    now = 9.0
    tracker.release(g4)
    tracker.advance()

    assert tracker.windows == [(1.0, 2.0), (3.0, 6.0)] and tracker.backlog_time == 4.0
    assert [g.window for g in (g1, g2, g3, g4)] == [0, 1, 2, 2]
    assert tracker.backlog_byte_seconds[HEAVY] == 220 and tracker.backlog_byte_seconds[light] == 60
    assert tracker.inherited_byte_seconds[HEAVY] == 120 and tracker.inside_byte_seconds[HEAVY] == 100
    assert tracker.inherited_byte_seconds[light] == 60 and tracker.inside_byte_seconds[light] == 0
    assert tracker.granted_work[HEAVY] == 200 and tracker.granted_work[light] == 150
    assert tracker.held[HEAVY] == tracker.held[light] == tracker.waiting[light] == 0 and tracker.waiting[HEAVY] == 1
    split = backlog_split(tracker)
    assert split["windows"] == 2
    assert split["inherited_shares"] == pytest.approx({HEAVY: 120 / 280, light: 60 / 280, **dict.fromkeys(LIGHTS[1:], 0)})
    assert split["inside_shares"] == pytest.approx({HEAVY: 100 / 280, **dict.fromkeys(LIGHTS, 0)})
    assert split["granted_shares"] == pytest.approx({HEAVY: 200 / 350, light: 150 / 350, **dict.fromkeys(LIGHTS[1:], 0)})
    assert split["heavy_floor"] == pytest.approx(0.3)


def test_fair_share_divides_byte_seconds_by_weight_while_all_are_backlogged() -> None:
    estimator = AnalyticEstimator.from_config(QWEN2_1_5B)
    budget = budget_bytes(DEVICE_BYTES, utilization=0.9, weights_bytes=WEIGHTS_BYTES, runtime_overhead_bytes=RUNTIME_OVERHEAD)
    # 4000 requests (the benchmark's): with 2000, all five are backlogged for only ~35 s, and the
    # shares over that window miss 0.2 by up to 0.09 depending on the seed (either lift rule).
    arrivals = tenant_workload(4000, seed=3, estimator=estimator, load=4.0, budget=budget)
    on, off = (simulate(fresh(arrivals, True), budget, fair, max_queue=Queues(4096), max_wait=30.0) for fair in (True, False))
    for result in (on, off):
        assert result["oom_count"] == 0
        assert result["budget_use_while_waiting"] >= 0.9
        assert sum(result[k] for k in ("ok", "oom", "rejected", "timeout")) == len(arrivals)
        assert result["all_backlogged_s"] > 10  # enough backlogged time to measure shares over
    # issue 11's bar: shares within 10% of the weights (0.2 each), Jain's index >= 0.95
    assert on["jain"] >= 0.95 and all(abs(on["shares"][t] - 0.2) <= 0.02 for t in (HEAVY, *LIGHTS))
    # The split adds up to the bar's measure; at 4x most of it is granted inside the windows.
    for t in TENANTS:
        assert on["inherited_shares"][t] + on["inside_shares"][t] == pytest.approx(on["shares"][t])
    assert sum(on["inherited_shares"].values()) < 0.5 and on["heavy_floor"] <= on["inherited_shares"][HEAVY]
    assert on["granted_jain"] >= 0.95
    assert off["jain"] < 0.6 and off["shares"][HEAVY] > 0.5


def test_at_2x_the_backlogged_shares_are_those_held_before_the_windows_opened() -> None:
    """docs/benchmarks.md, "Why the shares miss at 2x": the windows in which all five wait are
    short, nearly all their byte-seconds were granted before they opened, the heavy tenant's part
    of that alone is over the bar's 0.22, and inside them the rule grants the light tenants
    (lower virtual time) nearly everything."""
    estimator = AnalyticEstimator.from_config(QWEN2_1_5B)
    budget = budget_bytes(DEVICE_BYTES, utilization=0.9, weights_bytes=WEIGHTS_BYTES, runtime_overhead_bytes=RUNTIME_OVERHEAD)
    arrivals = tenant_workload(4000, seed=7, estimator=estimator, load=2.0, budget=budget)
    on = simulate(fresh(arrivals, True), budget, True, max_queue=Queues(4096), max_wait=30.0)
    assert on["shares"][HEAVY] > 0.22  # the bar missed, as in the benchmark's table
    assert sum(on["inherited_shares"].values()) > 0.95
    assert on["heavy_floor"] > 0.22
    assert on["granted_shares"][HEAVY] < 0.05


def test_a_per_tenant_queue_bound_keeps_the_heavy_tenant_from_filling_the_shared_queue() -> None:
    """With the default max_queue (256) the heavy tenant's backlog refuses light requests on
    arrival; 64 per tenant (TenantPolicy.max_queue) leaves room for them."""
    estimator = AnalyticEstimator.from_config(QWEN2_1_5B)
    budget = budget_bytes(DEVICE_BYTES, utilization=0.9, weights_bytes=WEIGHTS_BYTES, runtime_overhead_bytes=RUNTIME_OVERHEAD)
    arrivals = tenant_workload(2000, seed=3, estimator=estimator, load=4.0, budget=budget)
    shared, bounded = (
        simulate(fresh(arrivals, True), budget, True, max_queue=queues, max_wait=30.0)
        for queues in (Queues(256), Queues(256, 64))
    )
    assert bounded["light_not_admitted"] < shared["light_not_admitted"] / 2
    assert bounded["jain"] > shared["jain"]


def test_deadline_aware_admission_among_tenants_refuses_up_front_what_would_time_out() -> None:
    """Fair share on, each client with a deadline in [2, 30] s: the middleware's decision
    (``reserve`` with the tenant and ``wait_limit``) refuses some requests at once, and fewer time out in the
    queue than when every request waits until its client gives up."""
    estimator = AnalyticEstimator.from_config(QWEN2_1_5B)
    budget = budget_bytes(DEVICE_BYTES, utilization=0.9, weights_bytes=WEIGHTS_BYTES, runtime_overhead_bytes=RUNTIME_OVERHEAD)
    arrivals = clients(1000, seed=3, estimator=estimator, load=4.0, budget=budget, min_deadline=2.0, max_wait=30.0)
    off, on = (
        simulate(fresh(arrivals, True), budget, True, Queues(4096), 30.0, deadline_aware=aware) for aware in (False, True)
    )
    assert off["unmeetable"] == 0 and on["unmeetable"] > 0
    assert off["timeout"] > 100 and on["timeout"] < off["timeout"] / 2
    for result in (off, on):
        assert result["oom"] == result["oom_count"] == 0
        assert sum(result[k] for k in ("ok", "rejected", "unmeetable", "timeout")) == len(arrivals)


def test_verdict_judges_each_bar_by_its_threshold() -> None:
    """The verdict block: a share 9% off its weight meets the bar and 11% does not; the deadline
    bar needs both >= 80% fewer timeouts and no goodput lost among the requests served by the last
    arrival (fewer served in all, from a shorter queue left at the end, does not count against it)."""
    def run(share: float, jain_index: float) -> dict[str, Any]:
        shares = {HEAVY: 0.2, LIGHTS[0]: share, **dict.fromkeys(LIGHTS[1:], (0.8 - share) / 3)}  # light-1 off
        return {"light_p99_wait_s": 2.0, "budget_use_while_waiting": 0.95, "shares": shares, "jain": jain_index,
                "all_backlogged_s": 90.0}

    def absent() -> dict[str, Any]:
        return {"light_p99_wait_s": 1.0, "budget_use_while_waiting": 0.5}

    def deadline_pair(timeouts_on: int, ok_on: int) -> dict[bool, dict[str, Any]]:
        return {False: {"timeout": 100, "ok": 1000, "tokens": 10_000, "oom": 0, "ok_in_window": 900,
                        "tokens_in_window": 9_000},
                True: {"timeout": timeouts_on, "ok": ok_on - 50, "tokens": 9_500, "oom": 0, "ok_in_window": ok_on - 100,
                       "tokens_in_window": 9_000}}

    fairness = {("a", 4.0): {(True, True): run(0.218, 0.99), (True, False): absent()},
                ("b", 4.0): {(True, True): run(0.222, 0.94), (True, False): absent()}}
    deadlines = {("a", 4.0): deadline_pair(15, 1000), ("b", 4.0): deadline_pair(15, 999)}
    rows = {row[0]: row[2:] for row in verdict(fairness, deadlines, {"a": 0, "b": 2})}
    assert [cell.split(":")[0] for cell in rows["byte-s shares within 10% of weights"]] == ["met", "NOT met"]
    assert [cell.split(":")[0] for cell in rows["Jain's index >= 0.95"]] == ["met", "NOT met"]
    assert [cell.split(":")[0] for cell in rows["light p99 wait <= 1.5x heavy absent"]] == ["NOT met", "NOT met"]
    assert [cell.split(":")[0] for cell in rows["0 OOM (every run above)"]] == ["met", "NOT met"]
    deadline_cells = rows["timeouts >= 80% fewer with deadlines on, equal or better goodput (served by the last arrival)"]
    assert deadline_cells[0].startswith("met: 85.0% fewer") and deadline_cells[1].startswith("NOT met: 85.0% fewer")


def test_verdict_of_a_deadline_run_that_served_nothing_by_the_last_arrival_is_not_met_not_a_crash() -> None:
    """A tiny real-time run on a loaded machine may serve nothing before its last arrival: the
    deadline cell then says not met (as deadline_drop does for its own ratios), it does not divide by 0."""
    nothing = {"timeout": 10, "ok": 5, "tokens": 50, "oom": 0, "ok_in_window": 0, "tokens_in_window": 0}
    deadlines = {("a", 4.0): {False: nothing, True: {**nothing, "timeout": 1}}}
    rows = {row[0]: row[2:] for row in verdict({}, deadlines, {"a": 0})}
    (cell,) = rows["timeouts >= 80% fewer with deadlines on, equal or better goodput (served by the last arrival)"]
    assert cell.startswith("NOT met: 90.0% fewer") and "nan" in cell


@requires_redis_server
def test_the_redis_deadline_runs_cover_the_in_process_ones_arrival_sequences(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The benchmark's command, tiny: by default the Redis ledger's deadline runs are summed over
    the same arrival sequences as the in-process ones (``--deadline-seeds``), so the verdict
    compares the two ledgers on the same sums, not Redis on the first sequence alone."""
    monkeypatch.chdir(tmp_path)  # the report goes to ./reports
    monkeypatch.setattr(sys, "argv", ["bench_fairness", "--requests", "80", "--redis-requests", "80", "--loads", "",
                                      "--redis-loads", "", "--deadline-loads", "4.0", "--deadline-seeds", "2",
                                      "--max-queues", "4096"])
    main()
    report = json.loads((tmp_path / "reports" / "fairness.json").read_text())
    entries = [entry for entry in report["results"] if entry.get("deadlines")]
    summed = {entry["ledger"]: entry for entry in entries if len(entry["seeds"]) > 1}
    assert summed["memory"]["seeds"] == summed["redis"]["seeds"] == [7, 8]
    for run in ("off", "on"):
        assert len(summed["redis"][run]["per_seed"]) == 2
        counted = sum(summed["redis"][run][k] for k in ("ok", "rejected", "unmeetable", "timeout", "oom"))
        assert counted == 2 * 80  # every request of both sequences, each counted once
    assert any(entry["seeds"] == [7] and entry["ledger"] == "memory" for entry in entries)  # seed 7's twin rows


@requires_redis_server
async def test_the_redis_spy_records_the_prediction_the_deadline_decision_makes(
    redis_server: RedisServer, namespace: str
) -> None:
    """The benchmark reads the Redis ledger's predicted waits through a spy on its deadline
    decision; the spy must compute them as the decision does (a tenant quota changed its
    arguments once, and every Redis deadline run then failed)."""
    from gpu_asgi._ledger.redis.ledger import RedisLedger

    async with RedisLedger(redis_server.url, 100, namespace=namespace, tenants={"a": TenantPolicy(quota_bytes=60)}) as ledger:
        predictions = predicted_waits(ledger)
        first = await ledger.reserve(60, tenant="a")
        waiting = asyncio.ensure_future(ledger.reserve(50, tenant="a", timeout=10, wait_limit=30))
        await eventually(lambda: ledger.statistics().waiting == 1)
        first.release()
        (await waiting).release()
    assert list(predictions) == [waiting] and math.isfinite(predictions[waiting]) and predictions[waiting] > 0
