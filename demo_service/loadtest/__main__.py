"""``python -m demo_service.loadtest --url ... --clients 16 --requests 200 --out reports/loadtest``.

Drives N concurrent clients with a mixed prompt-length distribution, shows a progress bar, and
writes ``report.json`` plus ``latency.png``, ``throughput.png``, ``rejections.png`` and
``ledger.png`` (queue depth and reserved bytes over time, scraped from the server's ``/metrics``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

from ._runner import LoadTestConfig, run_load
from ._workload import DEFAULT_MIX, ENDPOINTS, parse_mix


def parse_args(argv: Sequence[str] | None = None) -> tuple[LoadTestConfig, Path]:
    parser = argparse.ArgumentParser(prog="python -m demo_service.loadtest", description=__doc__.split("\n\n")[1])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    parser.add_argument(
        "--endpoint", choices=sorted(ENDPOINTS), default="chat", help="API to drive (default %(default)s)"
    )
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default %(default)s)")
    parser.add_argument("--requests", type=int, default=200, help="requests in total (default %(default)s)")
    parser.add_argument(
        "--honour-retry-after",
        action="store_true",
        help="retry 503/429 answers after their Retry-After (else count them and move on)",
    )
    parser.add_argument("--max-retries", type=int, default=5, help="retries per request with --honour-retry-after")
    parser.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream answers (SSE; measures time to first token)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="new tokens per request (default: per length class)"
    )
    default_mix = ",".join(f"{c.name}:{c.weight}" for c in DEFAULT_MIX)
    parser.add_argument("--mix", default=default_mix, help=f"prompt length mix, name:weight (default {default_mix})")
    parser.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics scrapes")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request attempt")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt mix")
    parser.add_argument(
        "--out", type=Path, default=Path("reports/loadtest"), help="report folder (default %(default)s)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        mix = parse_mix(args.mix)
        config = LoadTestConfig(
            url=args.url,
            endpoint=args.endpoint,
            clients=args.clients,
            requests=args.requests,
            honour_retry_after=args.honour_retry_after,
            max_retries=args.max_retries,
            stream=args.stream,
            max_tokens=args.max_tokens,
            mix=mix,
            metrics_interval=args.metrics_interval,
            timeout=args.timeout,
            seed=args.seed,
            progress=not args.no_progress,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return config, args.out


def main(argv: Sequence[str] | None = None) -> None:
    from ._plots import write_plots
    from ._report import summarize, write_json

    config, out = parse_args(argv)
    result = asyncio.run(run_load(config))
    summary = summarize(result)
    report = write_json(summary, out)
    plots = write_plots(summary, out)
    headline = {k: summary[k] for k in ("requests", "latency_seconds", "throughput")}
    print(json.dumps(headline, indent=2))
    print(f"report: {report}; plots: {', '.join(str(p) for p in plots)}")


if __name__ == "__main__":
    main()
