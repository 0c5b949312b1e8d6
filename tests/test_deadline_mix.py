"""The request-by-request comparison behind docs/benchmarks.md ("Deadlines among tenants", why
tokens fall at 2x): a refused request keeps the prediction that refused it, and the per-class
table adds up to the two runs it compares."""

from __future__ import annotations

from gpu_asgi._ledger.drain import MIN_RETRY_AFTER
from tests.benchmarks.bench_deadline_mix import mix, run_pairs


def test_a_refused_or_timed_out_request_keeps_its_prediction() -> None:
    (pair,) = run_pairs(2.0, [3], requests=800, min_deadline=2.0, max_wait=30.0)
    refused = [a.request for a in pair.on if a.request.outcome == "unmeetable"]
    assert len(refused) > 50
    for r in refused:
        assert r.predicted is not None and r.predicted > r.deadline and r.predicted > MIN_RETRY_AFTER
    assert all(a.request.predicted is None for a in pair.off)  # deadlines off: nothing predicted
    # A request that queued and then timed out keeps the prediction it queued on (the table of
    # what leaves the queue unadmitted reads it).
    timed_out = [a.request for a in pair.on if a.request.outcome == "timeout"]
    assert timed_out and all(r.predicted is not None for r in timed_out)


def test_the_per_class_table_adds_up_to_the_two_runs() -> None:
    pairs = run_pairs(2.0, [3, 4], requests=800, min_deadline=2.0, max_wait=30.0)
    totals = {row[0]: row for row in mix(pairs) if row[1] == "all"}
    for name, heavy in (("heavy", True), ("lights", False)):
        served = [sum(p.served(a.request) for p in pairs for a in getattr(p, run) if (a.tenant == "heavy") == heavy)
                  for run in ("off", "on")]
        tokens = [sum(a.request.new_tokens for p in pairs for a in getattr(p, run)
                      if (a.tenant == "heavy") == heavy and p.served(a.request)) for run in ("off", "on")]
        assert totals[name][6] == f"{served[0]} -> {served[1]} ({served[1] - served[0]:+d})"
        assert totals[name][7] == f"{tokens[1] - tokens[0]:+d}"
