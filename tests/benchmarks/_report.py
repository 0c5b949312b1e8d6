"""Shared output for benchmarks: a table on stdout and a JSON file next to it."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any

REPORT_DIR = Path("reports")


def write_report(name: str, results: dict[str, Any]) -> Path:
    REPORT_DIR.mkdir(exist_ok=True)
    path = REPORT_DIR / f"{name}.json"
    meta = {"python": sys.version.split()[0], "machine": platform.machine(), "platform": platform.platform()}
    path.write_text(json.dumps({"meta": meta, **results}, indent=2))
    return path


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    return "\n".join(lines)
