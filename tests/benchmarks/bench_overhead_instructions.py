"""The overhead benchmark's cases counted in CPU instructions per request, under callgrind.

    python -m tests.benchmarks.bench_overhead_instructions [--requests 1000] [--jobs 2]

The same apps, requests and loop turns as ``bench_overhead`` (its ``build`` and ``drive``), but
each variant's requests are counted by valgrind's callgrind instead of timed. Instruction counts
do not depend on what else the machine runs, so the figures repeat from run to run on a shared
machine, where the timed ratios move by several points; they leave out what the time also holds
(cache misses, branch mispredictions), which is why both are reported.

One valgrind process per case: it builds every variant of the case, warms each up uninstrumented,
then drives each inside ``operator.call``. Callgrind collects only inside that call
(``--toggle-collect``) and writes one profile after each (``--dump-after``), so each profile's
total is one variant's requests and nothing of the start-up. The targets are ``bench_overhead``'s,
read the same way: instructions stand for time, so a throughput ratio is bare / wrapped.
"""

from __future__ import annotations

import argparse
import asyncio
import operator
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import bench_overhead as timed
from ._report import table, write_report

#: The C function callgrind collects inside: ``operator.call`` is CPython's ``_operator_call``.
TOGGLE = "_operator_call"
WARM_UP = 300
_TOTAL = re.compile(rb"^(?:summary|totals):\s+(\d+)", re.MULTILINE)


def variants(route: str) -> list[str]:
    """The variants of a case, in ``bench_overhead``'s order."""
    return ["bare", "gpu_asgi", "floor"] if route.startswith("tagged") else ["bare", "gpu_asgi", "pass-through", "watching"]


def child(framework: str, path: str, method: str, names: list[str], requests: int) -> None:
    """Runs under valgrind: each variant driven once inside ``operator.call``."""
    loop = asyncio.new_event_loop()
    apps = {name: timed.build({"bare": False, "gpu_asgi": True}.get(name, name), framework) for name in names}
    for app in apps.values():
        loop.run_until_complete(timed.drive(app, path, method, WARM_UP))
    for app in apps.values():
        operator.call(loop.run_until_complete, timed.drive(app, path, method, requests))
    loop.close()


def count(framework: str, path: str, method: str, names: list[str], requests: int) -> dict[str, float]:
    """Instructions per request of each variant, from one valgrind process."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "callgrind.out"
        command = [
            "valgrind", "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={TOGGLE}",
            f"--dump-after={TOGGLE}", f"--callgrind-out-file={out}",
            sys.executable, "-m", __spec__.name, "--child", framework, path, method, ",".join(names), str(requests),
        ]
        # A fixed hash seed: dict and set layouts, hence the instructions, the same in every run.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # One part per exit from operator.call: the variants, in order (the warm-up is not in one).
        totals = [total(Path(f"{out}.{part}")) for part in range(1, len(names) + 1)]
    if min(totals) == 0:
        raise RuntimeError(f"callgrind counted nothing inside {TOGGLE}: is this CPython's symbol table stripped?")
    return {name: n / requests for name, n in zip(names, totals)}


def total(profile: Path) -> int:
    match = _TOTAL.search(profile.read_bytes())
    if match is None:
        raise RuntimeError(f"no total in {profile}")
    return int(match.group(1))


def ratios(per_request: dict[str, float], tagged: bool, name: str) -> dict[str, Any]:
    """``bench_overhead``'s figures from instruction counts."""
    bare, wrapped = per_request["bare"], per_request["gpu_asgi"]
    result: dict[str, Any] = {"instructions": per_request, "ratio": bare / wrapped}
    if tagged:
        own, floor_own = wrapped - bare, per_request["floor"] - bare
        result.update(own=own, floor_own=floor_own, times_floor=own / floor_own)
        result["met"] = own / floor_own <= timed.TAGGED_TARGET
    else:
        result.update(pass_through_ratio=bare / per_request["pass-through"], watching_ratio=bare / per_request["watching"])
        result["met"] = result["ratio"] >= timed.untagged_target(name)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=2, help="valgrind processes at a time")
    parser.add_argument("--child", nargs=5, metavar=("FRAMEWORK", "PATH", "METHOD", "VARIANTS", "REQUESTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        framework, path, method, names, requests = args.child
        child(framework, path, method, names.split(","), int(requests))
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (Debian: apt-get install valgrind)")

    def case(spec: tuple[str, str, str, str]) -> tuple[str, dict[str, Any]]:
        framework, route, path, method = spec
        tagged = route.startswith("tagged")
        name = f"{framework}: {route}"
        return name, ratios(count(framework, path, method, variants(route), args.requests), tagged, name)

    with ThreadPoolExecutor(args.jobs) as pool:
        results = dict(pool.map(case, timed.CASES))
    rows = [
        [name, round(r["instructions"]["bare"]), round(r["instructions"]["gpu_asgi"]), r["ratio"],
         r.get("pass_through_ratio", "-"), r.get("watching_ratio", "-"),
         round(r["instructions"]["floor"]) if "floor" in r["instructions"] else "-",
         round(r["own"]) if "own" in r else "-", round(r["floor_own"]) if "floor_own" in r else "-",
         r.get("times_floor", "-"),
         f"ratio >= {timed.untagged_target(name)}" if "times_floor" not in r else f"own <= {timed.TAGGED_TARGET}x floor",
         "yes" if r["met"] else "NO"]
        for name, r in results.items()
    ]
    headers = [
        "route", "bare instr/req", "with gpu_asgi instr/req", "ratio", "pass-through ratio", "watching ratio",
        "floor instr/req", "own instr", "floor own instr", "× floor", "target", "met",
    ]
    print(table(rows, headers))
    print("report:", write_report("overhead_instructions", {"requests": args.requests, "results": results}))


if __name__ == "__main__":
    main()
