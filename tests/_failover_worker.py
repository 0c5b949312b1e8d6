"""One worker process of the failover chaos test: holds long leases on a shared RedisLedger under
load, and writes down what it held, when, and how every request ended.

    python -m tests._failover_worker URL NAMESPACE BUDGET SECONDS OUT [SEED]

It asks for SECONDS at least, then until it was granted a request asked after the fault (the time
the test writes to ``OUT.fault`` once the group has failed over), or CAP seconds have passed: a
busy machine can take longer to fail over than any fixed window allows, and the test needs grants
after the fault to measure the recovery.

Times are ``time.monotonic()`` (one clock for every process on the host). A lease counts as held
from the moment ``reserve`` returned it until just before ``release``: the span in which the
worker would use the memory.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from gpu_asgi import AdmissionRejected
from gpu_asgi._ledger.redis.ledger import RedisLedger

CONCURRENCY = 3
MAX_WAIT = 4.0
LEASE_TTL = 3.0
CAP = 40.0


async def main(url: str, namespace: str, budget: int, seconds: float, out: str, seed: int) -> None:
    rng = random.Random(seed)
    ledger = RedisLedger(url, budget, namespace=namespace, lease_ttl=LEASE_TTL, max_wait=MAX_WAIT, max_queue=64,
                         redis_timeout=0.5)
    records: list[dict[str, Any]] = []
    started = time.monotonic()
    fault_file = Path(out + ".fault")

    def asking() -> bool:
        now = time.monotonic()
        if now < started + seconds:
            return True
        if now > started + CAP or not fault_file.exists():
            return now <= started + CAP
        faulted = float(fault_file.read_text() or "inf")
        return not any(r["outcome"] == "granted" and r["asked"] > faulted for r in records)

    async def client() -> None:
        while asking():
            nbytes = rng.randrange(budget // 10, budget // 3)
            asked = time.monotonic()
            record: dict[str, Any] = {"bytes": nbytes, "asked": asked}
            try:
                reservation = await ledger.reserve(nbytes, deadline=MAX_WAIT)
            except AdmissionRejected as exc:  # LedgerUnavailable too, while no primary answers (fail-closed)
                record |= {"outcome": "refused", "reason": exc.reason, "retry_after": exc.retry_after, "why": str(exc)[:90]}
            except Exception as exc:  # anything else is a bug the test reports
                record |= {"outcome": "error", "error": f"{type(exc).__name__}: {exc}"}
            else:
                record |= {"outcome": "granted", "granted": time.monotonic()}
                await asyncio.sleep(rng.uniform(0.3, 1.2))  # a long generation
                record["released"] = time.monotonic()
                reservation.release()
            record["answered"] = time.monotonic()
            records.append(record)
            if record["outcome"] != "granted":
                await asyncio.sleep(0.05)

    await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
    await asyncio.sleep(0.3)  # the last releases reach Redis
    await ledger.aclose()
    with open(out, "w") as file:
        json.dump(records, file)


if __name__ == "__main__":
    url, namespace, budget, seconds, out = sys.argv[1:6]
    seed = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    asyncio.run(main(url, namespace, int(budget), float(seconds), out, seed))
