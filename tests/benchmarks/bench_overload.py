"""Overload on a simulated 24 GB GPU: gpu_asgi's ledger against no admission control and a semaphore.

    python -m tests.benchmarks.bench_overload [--requests 4000] [--load 2.5] [--seed 7]

A discrete-event simulation in virtual time, so it is deterministic and fast; the admission
decisions are made by the real ``Ledger`` and ``AnalyticEstimator`` (what the middleware calls),
driven on a real asyncio loop between events.

The device: 24 GiB, of which ``budget_bytes(24 GiB, 0.90, weights, overhead)`` is the budget,
running a Qwen2-1.5B-like model (fp16 KV cache, eager attention; config below). Each running
request really "allocates" its actual peak (the analytic cost of its prompt and of the tokens it
actually generates, at most ``max_new_tokens``) on a device that fails the allocation when it
would exceed its free memory: that is an out-of-memory error.

Timing model (batched decoding, memory-bound): a request takes ``prefill + new_tokens × step``,
where a decode step gets slower as more sequences share the GPU (``step = base + per_seq ×
running``), so admitting more requests raises throughput sub-linearly, as on a real GPU.

Policies, on the same arrival sequence:
- ``none``: everything runs at once (the bare app);
- ``semaphore``: ``asyncio.Semaphore(N)`` with N = budget // worst-case request (the article);
- ``gpu_asgi``: the byte ledger with the bounded bypass (default ``max_bypass``);
- ``gpu_asgi-fifo``: the same ledger with ``max_bypass=0`` (plain FIFO), for short requests' wait;
- ``deadlines-off`` / ``deadlines-on``: the ledger again, but each client gives up after its own
  deadline (uniform in [``--min-deadline``, ``--max-wait``] s); "on" refuses at once a request
  whose predicted wait exceeds its deadline (``reserve``'s ``wait_limit``, what the middleware passes).
  These two run on ``--deadline-seeds`` arrival sequences (seeds ``--seed``, ``--seed`` + 1, ...)
  and are compared on the sums: one sequence's outcome swings by several percent with any change
  of decisions (a refusal frees a queue slot that a later request takes, and so on).

Goodput is counted two ways: requests (and generated tokens) finished per second of *offered*
time (first to last arrival, the same for every policy on one sequence), and per second until the
last request finishes (which also counts the tail a policy takes to drain its queue).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpu_asgi import (
    AnalyticEstimator,
    DeadlineUnmeetable,
    Ledger,
    NeverFits,
    QueueFull,
    budget_bytes,
)

from ._report import table, write_report

GiB = 1 << 30
QWEN2_1_5B = {  # the published Qwen2-1.5B-Instruct config.json fields that matter here
    "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "hidden_size": 1536,
    "intermediate_size": 8960, "vocab_size": 151936, "torch_dtype": "float16",
    "attn_implementation": "eager",  # the simulated model runs eager attention (see above)
}
DEVICE_BYTES = 24 * GiB
WEIGHTS_BYTES = int(1.6 * GiB)  # AWQ int4 weights + fp16 embeddings, about what the checkpoint loads
RUNTIME_OVERHEAD = 1 * GiB  # CUDA context, cuBLAS workspaces, allocator slack
PREFILL_TOKENS_PER_S = 20_000.0
STEP_BASE_S = 0.012
STEP_PER_SEQ_S = 0.0004
SHORT_PROMPT = 256  # "short requests" for the wait comparison


@dataclass(slots=True)
class Request:
    arrival: float
    prompt_tokens: int
    max_new_tokens: int
    new_tokens: int  # what it actually generates (EOS comes before max_new_tokens)
    deadline: float = math.inf  # seconds this client waits for admission (deadlines-* policies)
    estimate: int = 0
    actual: int = 0
    admitted: float | None = None
    finished: float | None = None
    outcome: str = "pending"
    # The predicted wait when it queued (deadline-aware admission), unscaled seconds; bench_fairness's
    # in-process runs keep it for a refused request too.
    predicted: float | None = None


@dataclass
class Simulation:
    """Virtual clock, event heap and the simulated device."""

    capacity: int
    now: float = 0.0
    allocated: int = 0
    running: int = 0
    events: list[tuple[float, int, Callable[[], None]]] = field(default_factory=list)
    seq: int = 0
    # Time-weighted budget use while the queue is non-empty.
    busy_area: float = 0.0
    busy_time: float = 0.0
    last_sample: float = 0.0

    def at(self, when: float, action: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, action))

    def sample(self, queued: int, held: int) -> None:
        span = self.now - self.last_sample
        if queued and span > 0:
            self.busy_area += span * held / self.capacity
            self.busy_time += span
        self.last_sample = self.now

    def duration(self, request: Request) -> float:
        step = STEP_BASE_S + STEP_PER_SEQ_S * self.running
        return request.prompt_tokens / PREFILL_TOKENS_PER_S + request.new_tokens * step


def workload(n: int, seed: int, estimator: AnalyticEstimator, load: float, budget: int) -> list[Request]:
    """Prompt lengths log-uniform in [16, 4096]; arrivals Poisson at ``load`` × the memory capacity.

    Offered load = arrival rate × E[estimated bytes × service time] / budget (Little's law on memory):
    2.5 means the requests arriving would need 2.5 budgets to all run at once.
    """
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt = int(math.exp(rng.uniform(math.log(16), math.log(4096))))
        max_new = rng.choice((64, 128, 256, 512))
        new = max(1, int(max_new * rng.uniform(0.3, 1.0)))
        r = Request(0.0, prompt, max_new, new)
        r.estimate = estimator.estimate(prompt, max_new)
        r.actual = estimator.estimate(prompt, new)  # the cost model: what it really touches
        requests.append(r)
    sim = Simulation(budget)
    mean_cost = statistics.fmean(r.estimate * sim.duration(r) for r in requests)
    rate = load * budget / mean_cost
    t = 0.0
    for r in requests:
        t += rng.expovariate(rate)
        r.arrival = t
    return requests


def with_deadlines(template: list[Request], seed: int, low: float, high: float) -> list[Request]:
    """The same requests, each with a client deadline uniform in [low, high] seconds."""
    rng = random.Random(seed)
    return [Request(r.arrival, r.prompt_tokens, r.max_new_tokens, r.new_tokens, rng.uniform(low, high), r.estimate, r.actual)
            for r in template]


def run_policy(policy: str, template: list[Request], budget: int, worst: int, max_queue: int, max_wait: float) -> dict[str, Any]:
    requests = [Request(r.arrival, r.prompt_tokens, r.max_new_tokens, r.new_tokens, r.deadline, r.estimate, r.actual)
                for r in template]
    loop = asyncio.new_event_loop()
    sim = Simulation(budget)
    ledger = Ledger(budget, max_queue=max_queue, max_wait=1e9, max_bypass=0 if policy == "gpu_asgi-fifo" else 8,
                    clock=lambda: sim.now)
    slots = max(1, budget // worst)
    semaphore = asyncio.Semaphore(slots)
    waiting: list[int] = [0]

    def spin() -> None:
        async def idle() -> None:
            for _ in range(8):
                await asyncio.sleep(0)
        loop.run_until_complete(idle())

    def finish(r: Request, release: Callable[[], None]) -> None:
        sim.sample(waiting[0], held())
        sim.allocated -= r.actual
        sim.running -= 1
        r.finished, r.outcome = sim.now, "ok"
        release()
        spin()

    def start(r: Request, release: Callable[[], None]) -> None:
        r.admitted = sim.now
        if sim.allocated + r.actual > DEVICE_BYTES - WEIGHTS_BYTES - RUNTIME_OVERHEAD_REAL:
            r.outcome = "oom"  # CUDA out of memory: this request fails
            release()
            return
        sim.allocated += r.actual
        sim.running += 1
        sim.at(sim.now + sim.duration(r), lambda: finish(r, release))

    async def admit(r: Request) -> None:
        if policy == "none":
            start(r, lambda: None)
            return
        if policy == "semaphore":
            if waiting[0] >= max_queue:
                r.outcome = "rejected"
                return
            waiting[0] += 1
            try:
                await semaphore.acquire()
            finally:
                waiting[0] -= 1
            start(r, semaphore.release)
            return
        wait_limit = None
        if policy == "deadlines-on":  # the middleware's path: at once if it fits, else the ledger decides
            reservation = ledger.try_reserve(r.estimate)
            if reservation is not None:
                start(r, reservation.release)
                return
            wait_limit = r.deadline
        try:
            waiting[0] += 1
            reservation = await ledger.reserve(r.estimate, wait_limit=wait_limit)
        except DeadlineUnmeetable:
            r.outcome = "unmeetable"
            return
        except (QueueFull, NeverFits):
            r.outcome = "rejected"
            return
        finally:
            waiting[0] -= 1
        start(r, reservation.release)

    tasks: dict[int, asyncio.Task[None]] = {}

    def held() -> int:
        return ledger.statistics().reserved_bytes if policy.startswith(("gpu_asgi", "deadlines")) else sim.allocated

    def arrive(index: int, r: Request) -> None:
        sim.sample(waiting[0], held())
        tasks[index] = loop.create_task(admit(r))
        spin()
        sim.at(r.arrival + min(max_wait, r.deadline), lambda: timeout(index, r))

    def timeout(index: int, r: Request) -> None:
        if r.admitted is None and r.outcome == "pending":
            sim.sample(waiting[0], held())
            r.outcome = "timeout"
            tasks[index].cancel()
            spin()

    for index, r in enumerate(requests):
        sim.at(r.arrival, lambda index=index, r=r: arrive(index, r))
    while sim.events:
        sim.now, _, action = heapq.heappop(sim.events)
        action()
    loop.close()
    return summarize(policy, requests, sim, slots)


RUNTIME_OVERHEAD_REAL = RUNTIME_OVERHEAD  # the device really has this much outside the tensors


def summarize(policy: str, requests: list[Request], sim: Simulation, slots: int) -> dict[str, Any]:
    done = [r for r in requests if r.outcome == "ok"]
    span = max(r.finished for r in done) - min(r.arrival for r in requests)
    offered = max(r.arrival for r in requests) - min(r.arrival for r in requests)
    latency = sorted(r.finished - r.arrival for r in done)  # type: ignore[operator]
    short_waits = sorted(r.admitted - r.arrival for r in done if r.prompt_tokens <= SHORT_PROMPT)  # type: ignore[operator]
    count = {o: sum(r.outcome == o for r in requests) for o in ("ok", "oom", "rejected", "timeout", "unmeetable")}
    return {
        "policy": policy,
        **count,
        "goodput_rps": len(done) / span,
        "goodput_tokens_per_s": sum(r.new_tokens for r in done) / span,
        "offered_seconds": offered,
        "tokens": sum(r.new_tokens for r in done),
        "p50_latency_s": _pct(latency, 50),
        "p99_latency_s": _pct(latency, 99),
        "short_p99_wait_s": _pct(short_waits, 99),
        "budget_use_while_queued": sim.busy_area / sim.busy_time if sim.busy_time else None,
        "semaphore_slots": slots if policy == "semaphore" else None,
    }


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(len(values) * p / 100))]


def add_up(name: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs on several arrival sequences, summed: outcomes, tokens and offered seconds, and goodput
    (requests and tokens) per second of the summed offered time."""
    total: dict[str, Any] = {"policy": name, "per_seed": results}
    for key in ("ok", "oom", "rejected", "unmeetable", "timeout", "offered_seconds", "tokens"):
        total[key] = sum(result[key] for result in results)
    total["goodput_rps_offered"] = total["ok"] / total["offered_seconds"]
    total["goodput_tokens_per_s_offered"] = total["tokens"] / total["offered_seconds"]
    return total


def deadline_drop(off: dict[str, Any], on: dict[str, Any]) -> dict[str, float]:
    """Issue 11's deadline bar: timeouts in the queue off -> on (bar: >= 80% fewer) and goodput on
    over off, requests and tokens (bar: equal or better)."""
    return {
        "timeout_drop": 1 - on["timeout"] / off["timeout"] if off["timeout"] else math.nan,
        "goodput_change": on["ok"] / off["ok"] - 1 if off["ok"] else math.nan,
        "tokens_change": on["tokens"] / off["tokens"] - 1 if off["tokens"] else math.nan,
    }


def deadline_rows(seeds: range, requests: int, load: float, budget: int, worst: int, estimator: AnalyticEstimator,
                  max_queue: int, max_wait: float, min_deadline: float) -> dict[str, dict[str, Any]]:
    """``deadlines-off`` and ``deadlines-on`` on each seed's arrivals, summed (goodput over the summed offered time)."""
    runs: dict[str, list[dict[str, Any]]] = {"deadlines-off": [], "deadlines-on": []}
    for seed in seeds:
        clients = with_deadlines(workload(requests, seed, estimator, load, budget), seed, min_deadline, max_wait)
        for policy, results in runs.items():
            results.append(run_policy(policy, clients, budget, worst, max_queue, max_wait))
    return {policy: add_up(policy, results) for policy, results in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--load", type=float, default=2.5, help="offered load in budgets (>= 2)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--max-queue", type=int, default=256)
    parser.add_argument("--max-wait", type=float, default=30.0)
    parser.add_argument("--min-deadline", type=float, default=2.0, help="shortest client deadline (deadlines-* policies)")
    parser.add_argument("--deadline-seeds", type=int, default=8, help="arrival sequences for the deadlines-* rows")
    args = parser.parse_args()
    estimator = AnalyticEstimator.from_config(QWEN2_1_5B)
    budget = budget_bytes(DEVICE_BYTES, utilization=0.90, weights_bytes=WEIGHTS_BYTES, runtime_overhead_bytes=RUNTIME_OVERHEAD)
    worst = estimator.estimate(4096, 512)
    template = workload(args.requests, args.seed, estimator, args.load, budget)
    results = [run_policy(p, template, budget, worst, args.max_queue, args.max_wait)
               for p in ("none", "semaphore", "gpu_asgi", "gpu_asgi-fifo")]
    rows = [[r["policy"], r["ok"], r["oom"], r["rejected"], r["unmeetable"], r["timeout"], r["goodput_rps"], r["goodput_tokens_per_s"],
             r["p50_latency_s"], r["p99_latency_s"], r["short_p99_wait_s"],
             "-" if r["budget_use_while_queued"] is None else f"{r['budget_use_while_queued']:.1%}"] for r in results]
    print(f"budget {budget / GiB:.2f} GiB, worst-case request {worst / GiB:.3f} GiB, offered load {args.load}x")
    print(table(rows, ["policy", "ok", "OOM", "rejected", "refused: deadline", "timed out", "goodput req/s", "tokens/s",
                       "p50 s", "p99 s", "short p99 wait s", "budget use while queued"]))
    seeds = range(args.seed, args.seed + args.deadline_seeds)
    deadlines = deadline_rows(seeds, args.requests, args.load, budget, worst, estimator, args.max_queue, args.max_wait,
                              args.min_deadline)
    off, on = deadlines["deadlines-off"], deadlines["deadlines-on"]
    print(f"\nclient deadlines uniform in [{args.min_deadline:g}, {args.max_wait:g}] s, {len(seeds)} arrival sequences "
          f"(seeds {seeds.start}..{seeds.stop - 1}) of {args.requests} requests, summed")
    print(table([[r["policy"], r["ok"], r["oom"], r["rejected"], r["unmeetable"], r["timeout"], r["goodput_rps_offered"],
                  r["goodput_tokens_per_s_offered"]] for r in (off, on)],
                ["policy", "ok", "OOM", "rejected", "refused: deadline", "timed out", "goodput req/s (offered)", "tokens/s (offered)"]))
    change = deadline_drop(off, on)
    print(f"timeouts in the queue {change['timeout_drop']:.1%} fewer with deadlines on; goodput {change['goodput_change']:+.1%} "
          f"(requests), {change['tokens_change']:+.1%} (tokens); per sequence, timeouts off -> on: "
          + ", ".join(f"{a['timeout']}->{b['timeout']}" for a, b in zip(off["per_seed"], on["per_seed"], strict=True)))
    print("report:", write_report("overload", {"args": vars(args), "budget_bytes": budget, "worst_case_bytes": worst,
                                               "results": results, "deadlines": deadlines}))


if __name__ == "__main__":
    main()
