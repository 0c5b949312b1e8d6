"""The load test's workload for locust users (``pip install locust``; not a dependency of the demo).

Run from the repository root (locust puts the working directory on ``sys.path``); it imports
nothing but locust and the standard library, so ``pip install locust`` is all it needs.

    locust -f demo_service/loadtest/locustfile.py --host http://127.0.0.1:8000 \\
        --users 16 --spawn-rate 16 --run-time 2m --headless

Each user sends chat completions with prompts from the same mixed length distribution as
``python -m demo_service.loadtest``. A 503 or 429 is reported as a failure named after gpu_asgi's
reason (``queue-full``, ``queue-timeout``), and the user then waits the server's ``Retry-After``.
Queue depth and reserved bytes are not sampled here: scrape ``/metrics`` with Prometheus, or use
the demo's own load tester for plots.
"""

from __future__ import annotations

import itertools
import time

from locust import HttpUser, between, task

from demo_service.loadtest._retry import REASON_HEADER, parse_retry_after
from demo_service.loadtest._workload import make_jobs

_JOBS = make_jobs(1000, endpoint="chat", seed=0)
_NEXT = itertools.count()


class ChatUser(HttpUser):
    wait_time = between(0.0, 0.2)

    @task
    def chat(self) -> None:
        job = _JOBS[next(_NEXT) % len(_JOBS)]
        with self.client.post(
            "/v1/chat/completions", json=job.body, name=f"chat ({job.length_class})", catch_response=True
        ) as response:
            if response.status_code in (429, 503):
                reason = response.headers.get(REASON_HEADER, "rejected")
                response.failure(f"{response.status_code} {reason}")
                delay = parse_retry_after(response.headers.get("retry-after"))
                if delay:
                    time.sleep(min(delay, 30.0))  # locust's users are gevent greenlets: this yields
            elif response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
