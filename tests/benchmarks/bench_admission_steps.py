"""Where a tagged request's admission time goes: each step of the gate's ``admit``
timed alone, beside the whole of it, on the body ``bench_overhead`` sends.

    python -m tests.benchmarks.bench_admission_steps [--requests 100000] [--rounds 3]

Each figure is the best of ``rounds`` loops of ``requests`` calls (µs of this process's CPU time
per call), so a busy machine inflates it less. The steps do not add up to the whole exactly: the whole also builds
the admission record, sets the request state and runs the code between the steps.

The last rows run a request through the bare Starlette app of ``bench_overhead`` before each
``admit()``: the difference is what ``admit()`` costs when other code runs between two calls, as
it does inside an app (the CPU's caches and branch predictors are shared), rather than alone in
a tight loop. ``admit()`` is also run, alone and after a bare request, with ``GrantingLedger``
(grants every request, keeps no account) in place of the real ``Ledger``: the difference after a
bare request is what the ledger's ``try_reserve`` and ``release`` cost inside ``admit()`` in the
app, with the slowdown their code and data cause the code around them, which is more than the
same calls cost alone (the "ledger try_reserve + release" row).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gpu_asgi import DEFAULT_TENANT, Ledger, LinearEstimator, Reservation
from gpu_asgi._admission.body import check_headers, parse_request, read_body
from gpu_asgi._admission.gate import Gate
from gpu_asgi._admission.spec import RouteSpec
from gpu_asgi._estimate.tokens import HeuristicTokenCounter
from gpu_asgi._observe.tracing import get_tracer
from gpu_asgi._timers import DelayedCalls

from ._report import table, write_report
from .bench_overhead import BODY, build, scope_for

PROMPT = "word " * 196  # what parse_request finds in BODY


class GrantingLedger:
    """Reference only: grants every ``reserve_if_free`` and keeps no account, so ``admit()`` with it
    costs everything but the ledger's own work (a ``Reservation`` is still built and released)."""

    devices = ("cuda:0",)
    max_wait = 30.0

    async def reserve_if_free(self, nbytes: int, *, devices: Any = None, tenant: str = DEFAULT_TENANT) -> Reservation:
        return Reservation(self, "r", "cuda:0", nbytes, 0.0, tenant)  # type: ignore[arg-type]

    def give_back(self, reservation: Reservation, nbytes: int, *, finished: bool) -> None:
        pass


def gate(ledger: Any) -> Gate:
    """A gate as ``GPUAdmissionMiddleware`` builds it with its defaults."""
    return Gate(
        ledger=ledger, estimator=LinearEstimator(bytes_per_token=1), token_counter=HeuristicTokenCounter(),
        max_body_bytes=1 << 20, body_timeout=30.0, tenant_key=(), tenant_labels=frozenset(), tracer=get_tracer(),
    )


async def run(requests: int, rounds: int) -> dict[str, float]:
    admitting = gate(Ledger(1 << 40))
    spec = RouteSpec()
    message = {"type": "http.request", "body": BODY, "more_body": False}
    template = scope_for("/generate", "POST", None)  # type: ignore[arg-type]

    async def receive() -> dict[str, Any]:
        return message

    async def send(message: dict[str, Any]) -> None:
        pass

    granting = gate(GrantingLedger())

    async def whole(through: Gate = admitting) -> None:
        admission = await through.admit(dict(template), receive, spec)
        admission.reservation.release()

    bare_app = build(False)

    async def bare_request() -> None:
        await bare_app(dict(template), receive, send)

    async def bare_request_then_admit() -> None:
        await bare_request()
        await whole()

    async def bare_request_then_admit_granting() -> None:
        await bare_request()
        await whole_granting()

    deadlines = DelayedCalls(30.0)

    async def body() -> None:
        await read_body(receive, 1 << 20, deadlines)

    def span() -> None:
        started = admitting.tracer.start_span("step")
        started.is_recording()
        started.end()

    def reserve() -> None:
        reservation = admitting.ledger.try_reserve(1000)
        assert reservation is not None
        reservation.release()

    async def whole_granting() -> None:
        await whole(granting)

    steps: dict[str, Callable[[], Awaitable[None] | None]] = {
        "whole admit()": whole,
        "whole admit() with GrantingLedger": whole_granting,
        "check_headers": lambda: check_headers(template, 1 << 20),
        "read_body (with its deadline)": body,
        "parse_request": lambda: parse_request(BODY, spec, lambda: "route") and None,
        "count tokens (heuristic)": lambda: admitting.token_counter.count(PROMPT) and None,
        "estimate": lambda: admitting.estimator.estimate(200, 64, 1) and None,
        "queue-wait span (no SDK)": span,
        "ledger try_reserve + release": reserve,
        "bare Starlette request": bare_request,
        "bare Starlette request, then whole admit()": bare_request_then_admit,
        "bare Starlette request, then whole admit() with GrantingLedger": bare_request_then_admit_granting,
    }
    results: dict[str, float] = {}
    for name, step in steps.items():
        best = float("inf")
        for _ in range(rounds):
            start = time.process_time()
            for _ in range(requests):
                awaitable = step()
                if awaitable is not None:
                    await awaitable
            best = min(best, (time.process_time() - start) / requests * 1e6)
        results[name] = best
    results["whole admit() after a bare request (difference)"] = (
        results["bare Starlette request, then whole admit()"] - results["bare Starlette request"]
    )
    results["whole admit() with GrantingLedger after a bare request (difference)"] = (
        results["bare Starlette request, then whole admit() with GrantingLedger"] - results["bare Starlette request"]
    )
    results["the ledger's share of admit() after a bare request (Ledger - GrantingLedger)"] = (
        results["bare Starlette request, then whole admit()"]
        - results["bare Starlette request, then whole admit() with GrantingLedger"]
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results = asyncio.run(run(args.requests, args.rounds))
    print(table([[name, us] for name, us in results.items()], ["step", "µs per call"]))
    print("report:", write_report("admission_steps", {"requests": args.requests, "rounds": args.rounds, "us": results}))


if __name__ == "__main__":
    main()
