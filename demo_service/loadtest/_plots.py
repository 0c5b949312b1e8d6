"""PNG plots of a load-test summary (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen

from ._report import PERCENTILES

SIZE, DPI = (8, 3.6), 90
SMOOTHING_SECONDS = 10
MIB = 2**20


def write_plots(summary: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in (
        ("latency", _latency),
        ("throughput", _throughput),
        ("rejections", _rejections),
        ("ledger", _ledger),
    ):
        fig = draw(summary)
        path = out / f"{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        paths.append(path)
    return paths


def _latency(summary: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=SIZE)
    groups = {"all": summary["latency_seconds"]}
    groups.update({name: c["latency_seconds"] for name, c in summary["by_length_class"].items()})
    if summary["time_to_first_token_seconds"]["p50"] is not None:
        groups["first token"] = summary["time_to_first_token_seconds"]
    width = 0.8 / len(PERCENTILES)
    for i, q in enumerate(PERCENTILES):
        values = [(g[f"p{q}"] or 0.0) for g in groups.values()]
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=f"p{q}")
    ax.set_xticks([x + width * (len(PERCENTILES) - 1) / 2 for x in range(len(groups))], list(groups))
    ax.set_ylabel("seconds")
    ax.set_title("Latency percentiles of successful requests (by prompt length)")
    ax.legend(ncols=len(PERCENTILES), fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    return fig


def _throughput(summary: dict[str, Any]) -> Any:
    rows = summary["per_second"]
    fig, ax = plt.subplots(figsize=SIZE)
    ax.bar(rows["t"], rows["completed"], width=1.0, align="edge", alpha=0.5, label="requests completed / s")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("requests / s")
    tokens = ax.twinx()
    # Tokens are counted when their request completes, so a moving average reads better than bins.
    window = SMOOTHING_SECONDS
    smooth = [sum(rows["tokens"][max(0, i - window + 1) : i + 1]) / min(window, i + 1) for i in range(len(rows["t"]))]
    tokens.plot([t + 1 for t in rows["t"]], smooth, color="tab:red", label=f"tokens / s ({window} s average)")
    tokens.set_ylabel("tokens / s")
    tokens.set_ylim(bottom=0)
    throughput = summary["throughput"]
    ax.set_title(
        f"Throughput: {throughput['requests_per_second']:.2f} requests/s, "
        f"{throughput['completion_tokens_per_second']:.1f} tokens/s overall"
    )
    handles = ax.get_legend_handles_labels()[0] + tokens.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper left", fontsize="small")
    return fig


def _rejections(summary: dict[str, Any]) -> Any:
    rows = summary["per_second"]
    fig, ax = plt.subplots(figsize=SIZE)
    ax.bar(rows["t"], rows["rejected_503"], width=1.0, align="edge", label="503", color="tab:orange")
    ax.bar(
        rows["t"],
        rows["rejected_429"],
        width=1.0,
        align="edge",
        bottom=rows["rejected_503"],
        label="429",
        color="tab:purple",
    )
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("rejected attempts / s")
    counts = summary["requests"]["status_counts"]
    reasons = ", ".join(f"{k}: {v}" for k, v in summary["requests"]["rejections_by_reason"].items()) or "none"
    ax.set_title(f"Rejections: {counts.get('503', 0)} x 503, {counts.get('429', 0)} x 429 ({reasons})")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    return fig


def _ledger(summary: dict[str, Any]) -> Any:
    timeline = summary["timeline"]
    fig, (queue, memory) = plt.subplots(2, 1, figsize=(SIZE[0], SIZE[1] * 1.4), sharex=True)
    queue.step(timeline["t"], timeline["queue_depth"], where="post", label="waiting for memory")
    queue.step(timeline["t"], timeline["in_flight"], where="post", label="admitted (in flight)")
    queue.set_ylabel("requests")
    queue.set_title("The server's admission state, from /metrics")
    queue.legend(fontsize="small", loc="upper right")
    memory.fill_between(
        timeline["t"], [b / MIB for b in timeline["reserved_bytes"]], step="post", alpha=0.5, label="reserved"
    )
    memory.step(
        timeline["t"], [b / MIB for b in timeline["capacity_bytes"]], where="post", color="black", label="budget"
    )
    memory.set_ylabel("MiB")
    memory.set_xlabel("seconds since start")
    memory.legend(fontsize="small", loc="upper right")
    return fig
