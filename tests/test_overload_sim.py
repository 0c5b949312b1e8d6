"""The overload simulation behind docs/benchmarks.md, small: gpu_asgi never runs out of memory."""

from __future__ import annotations

from gpu_asgi import AnalyticEstimator, budget_bytes
from tests.benchmarks.bench_overload import (
    DEVICE_BYTES,
    QWEN2_1_5B,
    RUNTIME_OVERHEAD,
    WEIGHTS_BYTES,
    run_policy,
    with_deadlines,
    workload,
)


def test_ledger_admission_has_no_oom_where_no_admission_does() -> None:
    estimator = AnalyticEstimator.from_config(QWEN2_1_5B)
    budget = budget_bytes(DEVICE_BYTES, utilization=0.9, weights_bytes=WEIGHTS_BYTES, runtime_overhead_bytes=RUNTIME_OVERHEAD)
    worst = estimator.estimate(4096, 512)
    requests = workload(400, seed=3, estimator=estimator, load=2.5, budget=budget)
    results = {p: run_policy(p, requests, budget, worst, max_queue=64, max_wait=30.0) for p in ("none", "semaphore", "gpu_asgi")}
    assert results["none"]["oom"] > 0
    assert results["gpu_asgi"]["oom"] == 0 and results["semaphore"]["oom"] == 0
    assert results["gpu_asgi"]["goodput_rps"] > results["semaphore"]["goodput_rps"]
    assert results["gpu_asgi"]["budget_use_while_queued"] >= 0.9
    assert sum(results["gpu_asgi"][k] for k in ("ok", "rejected", "timeout")) == len(requests)


def test_deadline_aware_admission_refuses_up_front_what_would_time_out() -> None:
    """Clients with deadlines in [2, 30] s: the middleware's deadline decision (``deadlines-on``)
    refuses some requests at once, and fewer time out in the queue than without it."""
    estimator = AnalyticEstimator.from_config(QWEN2_1_5B)
    budget = budget_bytes(DEVICE_BYTES, utilization=0.9, weights_bytes=WEIGHTS_BYTES, runtime_overhead_bytes=RUNTIME_OVERHEAD)
    worst = estimator.estimate(4096, 512)
    requests = with_deadlines(workload(400, seed=3, estimator=estimator, load=2.5, budget=budget), 3, 2.0, 30.0)
    off, on = (run_policy(p, requests, budget, worst, max_queue=64, max_wait=30.0) for p in ("deadlines-off", "deadlines-on"))
    assert off["unmeetable"] == 0 and on["unmeetable"] > 0
    assert on["timeout"] < off["timeout"]
    assert on["oom"] == off["oom"] == 0
    for result in (off, on):
        assert sum(result[k] for k in ("ok", "rejected", "timeout", "unmeetable")) == len(requests)
