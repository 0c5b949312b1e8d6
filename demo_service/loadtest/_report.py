"""The load test's report: a JSON summary (percentiles, throughput, rejections, timelines)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from ._runner import REJECTED, LoadResult, RequestRecord

PERCENTILES = (50, 90, 95, 99)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: list[float]) -> dict[str, float | None]:
    summary: dict[str, float | None] = {f"p{q}": _round(percentile(values, q)) for q in PERCENTILES}
    summary["mean"] = _round(sum(values) / len(values)) if values else None
    summary["max"] = _round(max(values)) if values else None
    return summary


def per_second(records: list[RequestRecord], duration: float) -> dict[str, list[float]]:
    """Completions, rejections (503 and 429 attempts) and tokens, in one-second bins."""
    bins = max(1, math.ceil(duration))
    rows = {
        "t": [float(i) for i in range(bins)],
        "completed": [0.0] * bins,
        "tokens": [0.0] * bins,
        "rejected_503": [0.0] * bins,
        "rejected_429": [0.0] * bins,
    }
    for record in records:
        for attempt in record.attempts:
            if attempt.status in REJECTED:
                rows[f"rejected_{attempt.status}"][min(bins - 1, int(attempt.finished))] += 1
        if record.ok:
            at = min(bins - 1, int(record.finished))
            rows["completed"][at] += 1
            rows["tokens"][at] += record.completion_tokens
    return rows


def summarize(result: LoadResult) -> dict[str, Any]:
    records = result.records
    ok = [r for r in records if r.ok]
    attempts = [a for r in records for a in r.attempts]
    statuses = Counter(str(a.status) for a in attempts)
    reasons = Counter(a.reason for a in attempts if a.status in REJECTED and a.reason)
    by_class: dict[str, dict[str, Any]] = {}
    for name in sorted({r.length_class for r in records}):
        mine = [r for r in ok if r.length_class == name]
        by_class[name] = {
            "requests": sum(r.length_class == name for r in records),
            "succeeded": len(mine),
            "latency_seconds": distribution([r.latency for r in mine]),
            "mean_prompt_tokens": _round(sum(r.prompt_tokens for r in mine) / len(mine)) if mine else None,
        }
    config = dataclasses.asdict(result.config)
    config["mix"] = [dataclasses.asdict(c) for c in result.config.mix]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "config": config,
        "started_at": datetime.datetime.fromtimestamp(result.started_at, datetime.UTC).isoformat(timespec="seconds"),
        "duration_seconds": _round(result.duration),
        "requests": {
            "total": len(records),
            "succeeded": len(ok),
            "rejected": sum(r.status in REJECTED for r in records),
            "failed": sum(not r.ok and r.status not in REJECTED for r in records),
            "attempts": len(attempts),
            "retries": len(attempts) - len(records),
            "status_counts": dict(sorted(statuses.items())),
            "rejections_by_reason": dict(sorted(reasons.items())),
            "errors": sorted({r.error for r in records if r.error})[:10],
        },
        "latency_seconds": distribution([r.latency for r in ok]),
        "time_to_first_token_seconds": distribution(
            [r.time_to_first_token for r in ok if r.time_to_first_token is not None]
        ),
        "throughput": {
            "requests_per_second": _round(len(ok) / result.duration) if result.duration else None,
            "completion_tokens_per_second": _round(tokens / result.duration) if result.duration else None,
            "completion_tokens": tokens,
            "prompt_tokens": sum(r.prompt_tokens for r in ok),
        },
        "by_length_class": by_class,
        "per_second": per_second(records, result.duration),
        "timeline": {**dataclasses.asdict(result.timeline), "interval_seconds": result.config.metrics_interval},
    }


def write_json(summary: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
