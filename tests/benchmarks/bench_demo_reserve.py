"""The demo with strict and with learned reservations, side by side, at 0 OOM.

    python -m tests.benchmarks.bench_demo_reserve [--requests 48] [--max-tokens 1024] [--rows 4]

The real demo app (gpu_asgi in front, the tiny local Qwen2 on the CPU, served by uvicorn on
127.0.0.1) is run once per reservation rule with the same budget: room for ``--rows`` requests at
their worst case (``prompt + max_tokens``). Each run first teaches the route what its answers are
like (``--teach`` requests, in waves, not measured; strict learns nothing from them), then
sends ``--requests`` completions at once.

Two workloads. **Early-ending**: sampled at temperature 1 with ``stop: ["z"]``: about one sampled
token in 90 holds a "z", so lengths are roughly geometric (mean about 90) under a declared
``max_tokens`` of 1,024, as answers that end at EOS are. **Fixed**: no stop string, every answer
runs to a ``max_tokens`` of 128 (the random model never samples EOS).

"0 OOM" is checked, not assumed: at every decoding step the running batch's padded cost at that
length (the estimator the ledger admits with) must be covered by the bytes the batch holds in the
ledger (its requests' reservations and its loans), and the ledger's reserved bytes never exceed the
budget. Both counts are in the table (``uncovered steps``, ``peak reserved / budget``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import uvicorn

from demo_service import DemoSettings, create_app, ensure_local_model, load_model

from ._report import table, write_report

EARLY, FIXED = "early-ending", "fixed"
RULES = ("strict", "learned", "0.75")


def body(model: str, index: int, workload: str, max_tokens: int) -> dict[str, Any]:
    request: dict[str, Any] = {"model": model, "prompt": f"Tell me story number {index}.", "temperature": 1.0}
    if workload == EARLY:
        request.update(max_tokens=max_tokens, stop=["z"], seed=index)
    else:
        request.update(max_tokens=128, seed=index)
    return request


class StepCheck:
    """Every decoding step of the demo's batcher, against the bytes its batch holds."""

    def __init__(self, app: Any) -> None:
        service = app.state.service
        self.batcher, self.ledger = service.batcher, service.ledger
        self.estimator = self.batcher.estimator
        self.capacity = self.ledger.statistics().devices[0].capacity_bytes
        self.steps = self.uncovered = self.peak = 0
        step = self.batcher._on_step

        def on_step(slots: Any, tokens: Any) -> None:
            step(slots, tokens)
            run = self.batcher.current
            produced = max(len(s.text.token_ids) + (s.finish_reason is not None) for _, s in slots)
            self.steps += 1
            if run is not None and self.estimator.batch_bytes(run.prompts, [produced]) > run.covered_bytes:
                self.uncovered += 1
            self.peak = max(self.peak, self.ledger.statistics().reserved_bytes)

        self.batcher._on_step = on_step


async def run_rule(model: Any, rule: str, workload: str, args: argparse.Namespace, budget: int) -> dict[str, Any]:
    settings = DemoSettings(
        progress=False, reserve=rule, budget_bytes=budget, max_queue=args.requests + 8, max_wait=600.0,
        max_new_tokens_cap=max(args.max_tokens, 128), max_batch_size=16, batch_window_ms=10.0,
    )
    app = create_app(settings, model=model)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    while not app.state.lifecycle.ready:
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    name = app.state.service.model_name
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=900) as http:
            # What the route's answers are like (not measured): in waves of --rows, as a burst would come.
            for wave in range(0, args.teach, args.rows):
                taught = await asyncio.gather(*(
                    http.post("/v1/completions", json=body(name, 10_000 + i, workload, args.max_tokens))
                    for i in range(wave, min(args.teach, wave + args.rows))
                ))
                for response in taught:
                    response.raise_for_status()
            check = StepCheck(app)
            batches_before = len(app.state.service.batcher.batch_sizes)
            metrics = app.state.service.batcher.metrics
            grown_before = metrics.growth_bytes._value.get()

            async def one(index: int) -> tuple[float, int, int]:
                started = time.perf_counter()
                response = await http.post("/v1/completions", json=body(name, index, workload, args.max_tokens))
                tokens = response.json()["usage"]["completion_tokens"] if response.status_code == 200 else 0
                return time.perf_counter() - started, response.status_code, tokens

            started = time.perf_counter()
            results = await asyncio.gather(*(one(i) for i in range(args.requests)))
            wall = time.perf_counter() - started
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)
    latencies = sorted(r[0] for r in results)
    ok = [r for r in results if r[1] == 200]
    sizes = list(app.state.service.batcher.batch_sizes)[batches_before:]
    return {
        "rule": rule,
        "workload": workload,
        "completed": len(ok),
        "refused": len(results) - len(ok),
        "tokens": sum(r[2] for r in ok),
        "tokens_per_second": sum(r[2] for r in ok) / wall,
        "mean_tokens": statistics.mean(r[2] for r in ok) if ok else 0.0,
        "p50_s": latencies[len(latencies) // 2],
        "p99_s": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
        "mean_batch_rows": statistics.mean(sizes) if sizes else 0.0,
        "grown_mib": (metrics.growth_bytes._value.get() - grown_before) / 2**20,
        "growth_denied": metrics.growth_denied._value.get(),
        "steps": check.steps,
        "uncovered_steps": check.uncovered,
        "peak_reserved_share": check.peak / check.capacity,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = load_model(ensure_local_model(progress=False), device="cpu", progress=False)
    from demo_service import BucketedEstimator
    from gpu_asgi import AnalyticEstimator

    estimator = BucketedEstimator(AnalyticEstimator.from_config(model.model.config, dtype=model.dtype))
    rows = []
    for workload in (EARLY, FIXED):
        limit = args.max_tokens if workload == EARLY else 128
        budget = args.rows * estimator.estimate(16, limit)  # room for --rows requests at their worst case
        for rule in RULES:
            result = await run_rule(model, rule, workload, args, budget)
            result["budget_mib"] = budget / 2**20
            rows.append(result)
            print(f"{workload} {rule}: {result['tokens_per_second']:.1f} tokens/s", flush=True)
    for row in rows:
        strict = next(r for r in rows if r["workload"] == row["workload"] and r["rule"] == "strict")
        row["vs_strict"] = row["tokens_per_second"] / strict["tokens_per_second"]
    return {"rows": rows, "args": vars(args)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--teach", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=4, help="requests the budget holds at their worst case")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    header = ["workload", "rule", "tokens/s", "× strict", "p50 s", "p99 s", "mean tokens", "refused",
              "batch rows", "grown MiB", "denied", "uncovered steps", "peak/budget"]
    print(table([[r["workload"], r["rule"], r["tokens_per_second"], r["vs_strict"], r["p50_s"], r["p99_s"],
                  r["mean_tokens"], r["refused"], r["mean_batch_rows"], r["grown_mib"], r["growth_denied"],
                  f"{r['uncovered_steps']}/{r['steps']}", r["peak_reserved_share"]] for r in results["rows"]], header))
    print(write_report("demo_reserve", results))


if __name__ == "__main__":
    main()
