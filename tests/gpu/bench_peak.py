"""``tests.benchmarks.bench_peak_memory`` under a deadline, for a one-shot run on a lent GPU machine.

    python3 tests/gpu/bench_peak.py --deadline 150 --out $OUT/bench_peak_memory.json -- --device cuda

Runs the benchmark's own ``main()`` (same grid, models, measurements, table and report), with two
changes made from outside: no case *starts* after ``--deadline`` seconds (the rest are listed in
the report as ``skipped_for_time``), and the report (``reports/bench_peak_memory.json`` as the
benchmark writes it, plus ``complete``/``skipped_for_time``) is also written to ``--out`` after
every case, so a run killed by a timeout still returns what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.benchmarks import bench_peak_memory as bench
from tests.benchmarks._report import write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deadline", type=float, required=True, help="seconds after which no case starts")
    parser.add_argument("--out", type=Path, required=True, help="where the report is copied, after every case")
    parser.add_argument("bench_args", nargs="*", help="the benchmark's own arguments (after --)")
    args = parser.parse_args()
    deadline = time.monotonic() + args.deadline
    cases = bench.cases
    skipped: list[dict[str, Any]] = []
    measured: list[dict[str, Any]] = []
    started = time.perf_counter()

    def write(report: dict[str, Any], complete: bool) -> None:
        body = {**report, "complete": complete, "skipped_for_time": skipped,
                "wall_seconds": round(time.perf_counter() - started, 1)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=2))
        tmp.replace(args.out)

    def timed_cases(quick: bool, dtypes: tuple[str, ...]) -> Iterator[bench.Case]:
        for case in cases(quick, dtypes):
            if time.monotonic() > deadline:
                skipped.append(dataclasses.asdict(case))
            else:
                yield case

    measure = bench.measure

    def measure_and_save(model: Any, case: bench.Case, device: str) -> dict[str, Any]:
        result = measure(model, case, device)
        measured.append(result)
        write({"partial": True, "cases": measured, "failed": sum(not r["within_bars"] for r in measured)}, False)
        return result

    def write_both(name: str, results: dict[str, Any]) -> Path:
        path = write_report(name, results)
        write(json.loads(path.read_text()), not skipped)
        return path

    bench.cases = timed_cases
    bench.measure = measure_and_save
    bench.write_report = write_both  # type: ignore[attr-defined]  # main() looks it up in its module
    sys.argv = ["bench_peak_memory", *args.bench_args]
    bench.main()
    print(f"bench_peak: {len(measured)} cases measured, {len(skipped)} skipped for time, "
          f"{time.perf_counter() - started:.0f} s; report {args.out}")


if __name__ == "__main__":
    main()
