"""Deadline-aware admission among tenants, request by request: which requests it serves instead of which.

    python -m tests.benchmarks.bench_deadline_mix [--loads 2.0,4.0] [--seed 7] [--deadline-seeds 8]

bench_fairness's deadline runs (fair share on, ``max_queue`` 4096, the in-process ledger in
virtual time, client deadlines uniform in [2 s, 30 s]): deadlines off and on, on the same arrival
sequences, and the two runs' requests matched one to one. "Served" is served by the last arrival
(what the verdict judges). Printed, per load, summed over the sequences:

1. per tenant group (heavy, the four lights together) and size class (``nbytes.bit_length()``, the
   ledger's lanes): arrivals, mean bytes and generated tokens, the share refused with deadlines
   on, and the requests and tokens served off -> on;
2. the heavy tenant's requests that queued with deadlines on, per size class: the real wait over
   the prediction that let them queue (admitted ones), their median real wait, and the share of
   them that timed out;
3. the order the heavy tenant's queue really moves in, for those of them that were admitted: its
   bytes admitted during their wait that arrived before them (of their size class or smaller, and
   larger) and after them; the bytes it had queued before them when they arrived, and the part of
   those that left without admission before their turn;
4. requests refused with deadlines on that were served with them off: their prediction over
   their deadline, and when in the run they arrived.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from gpu_asgi import AnalyticEstimator, budget_bytes

from ._report import table
from .bench_fairness import HEAVY, Arrival, Queues, clients, fresh, simulate
from .bench_overload import DEVICE_BYTES, QWEN2_1_5B, RUNTIME_OVERHEAD, WEIGHTS_BYTES, Request, _pct

MiB = 1 << 20


@dataclass(frozen=True)
class Pair:
    """One arrival sequence run with deadlines off and on; ``last`` is its last arrival, ``use``
    the budget used while anyone waits in each run."""

    off: list[Arrival]
    on: list[Arrival]
    last: float
    use: tuple[float, float]

    def served(self, r: Request) -> bool:
        return r.outcome == "ok" and r.finished is not None and r.finished <= self.last


def run_pairs(load: float, seeds: Iterable[int], requests: int, min_deadline: float, max_wait: float) -> list[Pair]:
    estimator = AnalyticEstimator.from_config(QWEN2_1_5B)
    budget = budget_bytes(DEVICE_BYTES, utilization=0.90, weights_bytes=WEIGHTS_BYTES, runtime_overhead_bytes=RUNTIME_OVERHEAD)
    pairs = []
    for seed in seeds:
        arrivals = clients(requests, seed, estimator, load, budget, min_deadline, max_wait)
        runs = [fresh(arrivals, True) for _ in range(2)]
        off, on = (simulate(run, budget, True, Queues(4096), max_wait, aware) for run, aware in zip(runs, (False, True)))
        use = (off["budget_use_while_waiting"], on["budget_use_while_waiting"])
        pairs.append(Pair(runs[0], runs[1], max(a.request.arrival for a in arrivals), use))
    return pairs


def group(a: Arrival) -> str:
    return "heavy" if a.tenant == HEAVY else "lights"


def size_class(r: Request) -> int:
    return r.estimate.bit_length()


def class_label(c: int) -> str:
    return f"{c} ({(1 << (c - 1)) / MiB:g}-{(1 << c) / MiB:g} MiB)"


def mix(pairs: list[Pair]) -> list[list[object]]:
    """Table 1: per tenant group and size class, what deadlines on serves instead of off."""
    cells: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0] * 7)
    for pair in pairs:
        for off, on in zip(pair.off, pair.on, strict=True):
            r, s = off.request, on.request
            c = cells[group(off), size_class(r)]
            was, now = pair.served(r), pair.served(s)
            for i, v in enumerate((1, r.estimate, r.new_tokens, s.outcome == "unmeetable", was, now, (now - was) * r.new_tokens)):
                c[i] += v
    rows: list[list[object]] = []
    for (name, c), (n, nbytes, tokens, refused, was, now, change) in sorted(cells.items()):
        rows.append([name, class_label(c), n, round(nbytes / n / MiB), round(tokens / n), f"{refused / n:.2f}",
                     f"{was} -> {now} ({now - was:+d})", f"{change:+d}"])
    for name in ("heavy", "lights"):
        mine = [v for (g, _), v in cells.items() if g == name]
        was, now = sum(v[4] for v in mine), sum(v[5] for v in mine)
        rows.append([name, "all", sum(v[0] for v in mine), "", "", "", f"{was} -> {now} ({now - was:+d})",
                     f"{sum(v[6] for v in mine):+d}"])
    return rows


MIX_HEADER = ["tenant", "size class", "arrivals", "mean MiB", "mean tokens", "refused (on)", "served off -> on",
              "tokens on - off"]


def heavy_queued(pair: Pair) -> tuple[list[Request], list[Request]]:
    """With deadlines on: every heavy request of the run, and those that queued (they have a
    prediction and were not refused)."""
    heavy = [a.request for a in pair.on if a.tenant == HEAVY]
    return heavy, [r for r in heavy if r.predicted is not None and r.outcome != "unmeetable"]


def calibration(pairs: list[Pair]) -> list[list[object]]:
    """Table 2: the heavy tenant's queued requests per size class: real wait against predicted."""
    cells: dict[int, list[Request]] = defaultdict(list)
    for pair in pairs:
        for r in heavy_queued(pair)[1]:
            cells[size_class(r)].append(r)
    rows: list[list[object]] = []
    for c, queued in sorted(cells.items()):
        waits = sorted(r.admitted - r.arrival for r in queued if r.admitted is not None)
        ratios = sorted((r.admitted - r.arrival) / r.predicted for r in queued if r.admitted is not None and r.predicted)
        rows.append([class_label(c), len(queued), _pct(ratios, 25), _pct(ratios, 50), _pct(ratios, 75),
                     statistics.fmean(r.predicted for r in queued if r.predicted), _pct(waits, 50),
                     f"{sum(r.outcome == 'timeout' for r in queued) / len(queued):.2f}"])
    return rows


CALIBRATION_HEADER = ["size class", "queued", "wait / predicted p25", "median", "p75", "mean predicted s",
                      "median wait s", "timed out"]


def queue_order(pairs: list[Pair]) -> list[list[object]]:
    """Table 3: whose bytes the heavy tenant's queue admits while one of its requests waits."""
    cells: dict[int, list[list[int]]] = defaultdict(list)
    for pair in pairs:
        heavy, queued = heavy_queued(pair)
        admissions = sorted((h.admitted, h.arrival, h.estimate) for h in heavy if h.admitted is not None)
        times = [a[0] for a in admissions]
        for r in queued:
            if r.admitted is None or r.admitted == r.arrival:
                continue
            older_small = older_large = younger = 0
            for _, arrival, nbytes in admissions[bisect.bisect_right(times, r.arrival):bisect.bisect_left(times, r.admitted)]:
                if arrival >= r.arrival:
                    younger += nbytes
                elif nbytes.bit_length() <= size_class(r):
                    older_small += nbytes
                else:
                    older_large += nbytes
            before = [h for h in queued if h.arrival < r.arrival < _leaves(h)]
            left = sum(h.estimate for h in before if h.admitted is None and _leaves(h) <= r.admitted)
            cells[size_class(r)].append([older_small, older_large, younger, sum(h.estimate for h in before), left])
    rows: list[list[object]] = []
    for c, values in sorted(cells.items()):
        mean = [statistics.fmean(v[i] for v in values) / MiB for i in range(5)]
        rows.append([class_label(c), len(values), *(round(m) for m in mean), f"{mean[4] / mean[3]:.0%}"])
    return rows


def _leaves(r: Request) -> float:
    """When a queued request left the queue: admitted, or at its client's deadline (``with_deadlines``
    draws none above ``max_wait``, so that is bench_fairness's timeout)."""
    return r.admitted if r.admitted is not None else r.arrival + r.deadline


ORDER_HEADER = ["size class", "admitted", "admitted during its wait MiB: older, its class or smaller", "older, larger",
                "younger", "queued before it at arrival MiB", "of those, left unadmitted before its turn MiB",
                "share left"]


def refused_but_served(pairs: list[Pair]) -> list[list[object]]:
    """Table 4: refused with deadlines on, served with them off: by how much, and when."""
    rows: list[list[object]] = []
    for name in ("heavy", "lights"):
        hits = [(on.request, on.request.arrival / pair.last) for pair in pairs
                for off, on in zip(pair.off, pair.on, strict=True)
                if group(on) == name and on.request.outcome == "unmeetable" and pair.served(off.request)]
        if not hits:
            rows.append([name, 0, "", "", "", "", ""])
            continue
        ratios = sorted(r.predicted / r.deadline for r, _ in hits if r.predicted)
        thirds = [sum(int(3 * f) == i or (i == 2 and f >= 1) for _, f in hits) for i in range(3)]
        rows.append([name, len(hits), _pct(ratios, 10), _pct(ratios, 50), _pct(ratios, 90),
                     f"{sum(x <= 1.15 for x in ratios) / len(ratios):.2f}", " / ".join(map(str, thirds))])
    return rows


REFUSED_HEADER = ["tenant", "refused on, served off", "predicted / deadline p10", "median", "p90",
                  "share <= 1.15", "arrived in the run's thirds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", default="2.0,4.0")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--deadline-seeds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--min-deadline", type=float, default=2.0)
    parser.add_argument("--max-wait", type=float, default=30.0)
    args = parser.parse_args()
    seeds = range(args.seed, args.seed + args.deadline_seeds)
    for load in (float(x) for x in args.loads.split(",") if x):
        pairs = run_pairs(load, seeds, args.requests, args.min_deadline, args.max_wait)
        print(f"\n== load {load:g}x, seeds {seeds.start}-{seeds.stop - 1}, {args.requests} requests each; served = by the last arrival")
        print(table(mix(pairs), MIX_HEADER))
        print("budget used while anyone waits, per sequence, off / on: "
              + ", ".join(f"{p.use[0]:.1%} / {p.use[1]:.1%}" for p in pairs))
        print("\nheavy tenant, queued with deadlines on")
        print(table(calibration(pairs), CALIBRATION_HEADER))
        print("\nheavy tenant, queued with deadlines on and admitted: the order its queue moves in (means)")
        print(table(queue_order(pairs), ORDER_HEADER))
        print()
        print(table(refused_but_served(pairs), REFUSED_HEADER))


if __name__ == "__main__":
    main()
