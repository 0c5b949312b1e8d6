"""Dynamic batching in the demo: throughput at 16 concurrent clients, batching on versus off.

    python -m tests.benchmarks.bench_batching [--clients 16] [--requests-per-client 3] [--rounds 2]

The real demo app (gpu_asgi in front, the tiny local Qwen2 on the CPU) is driven in-process through
``httpx.ASGITransport``: each client sends its chat completions one after another (a closed loop),
all with the same short prompts, greedy, a fixed number of new tokens. "Off" is the same app with
``max_batch_size=1`` (one ``generate`` per request, one after another on the device thread); "on" is
``max_batch_size=16`` with a 15 ms window. Rounds alternate off/on; the ratio is the median over
rounds of (tokens/s on) / (tokens/s off).
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

from demo_service import DemoSettings, create_app, load_model

from ._report import table, write_report

TOPICS = ["rivers", "mountains", "bridges", "volcanoes", "deserts", "forests", "glaciers", "islands"]


def body(client: int, request: int, max_tokens: int) -> dict[str, Any]:
    topic = TOPICS[(client + request) % len(TOPICS)]
    return {
        "messages": [{"role": "user", "content": f"Name a few famous {topic} and say one thing about each."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


async def drive(
    model: Any, *, batching: bool, clients: int, per_client: int, max_tokens: int, window_ms: float
) -> dict[str, Any]:
    settings = DemoSettings(
        progress=False,
        max_batch_size=16 if batching else 1,
        batch_window_ms=window_ms if batching else 0.0,
    )
    app = create_app(settings, model=model)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as http:
            await http.post("/v1/chat/completions", json=body(0, 0, 4))  # warm up

            async def client(index: int) -> int:
                tokens = 0
                for request in range(per_client):
                    response = await http.post("/v1/chat/completions", json=body(index, request, max_tokens))
                    response.raise_for_status()
                    tokens += response.json()["usage"]["completion_tokens"]
                return tokens

            batcher = app.state.service.batcher
            calls_before = batcher.generate_calls
            start = time.perf_counter()
            tokens = sum(await asyncio.gather(*(client(i) for i in range(clients))))
            elapsed = time.perf_counter() - start
            sizes = list(batcher.batch_sizes)[1:]  # without the warm-up
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_second": tokens / elapsed,
        "requests_per_second": clients * per_client / elapsed,
        "generate_calls": batcher.generate_calls - calls_before,
        "mean_batch_size": statistics.fmean(sizes) if sizes else 0.0,
    }


async def run(clients: int, per_client: int, max_tokens: int, rounds: int, window_ms: float) -> dict[str, Any]:
    model = load_model(None, device="cpu", progress=True)
    kwargs = {"clients": clients, "per_client": per_client, "max_tokens": max_tokens, "window_ms": window_ms}
    off, on, ratios = [], [], []
    for _ in range(rounds):
        off.append(await drive(model, batching=False, **kwargs))
        on.append(await drive(model, batching=True, **kwargs))
        ratios.append(on[-1]["tokens_per_second"] / off[-1]["tokens_per_second"])
    return {
        "clients": clients,
        "requests_per_client": per_client,
        "max_tokens": max_tokens,
        "window_ms": window_ms,
        "unbatched": off,
        "batched": on,
        "ratios": ratios,
        "ratio": statistics.median(ratios),
        "target": 3.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window-ms", type=float, default=15.0)
    args = parser.parse_args()
    results = asyncio.run(run(args.clients, args.requests_per_client, args.max_tokens, args.rounds, args.window_ms))
    rows = []
    for mode in ("unbatched", "batched"):
        runs = results[mode]
        rows.append(
            [
                mode,
                statistics.median(r["tokens_per_second"] for r in runs),
                statistics.median(r["requests_per_second"] for r in runs),
                int(statistics.median(r["generate_calls"] for r in runs)),
                statistics.median(r["mean_batch_size"] for r in runs),
            ]
        )
    print(table(rows, ["mode", "tokens/s", "requests/s", "generate calls", "mean batch size"]))
    print(
        f"ratio (median of {args.rounds} rounds): {results['ratio']:.2f}x  (target {results['target']}x)  rounds: "
        + ", ".join(f"{r:.2f}" for r in results["ratios"])
    )
    print("report:", write_report("batching", results))


if __name__ == "__main__":
    main()
