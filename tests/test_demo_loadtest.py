"""The load tester: against the real demo, against a server that says 503 + Retry-After, and its CLI."""

from __future__ import annotations

import asyncio
import email.utils
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

pytest.importorskip("matplotlib")

from demo_service.loadtest import LoadTestConfig, make_jobs, parse_mix, parse_retry_after, run_load, summarize
from demo_service.loadtest._plots import write_plots
from demo_service.loadtest._report import percentile
from demo_service.loadtest._scrape import parse_gauges

from ._asgi import wait_until

METRICS = """# TYPE gpu_asgi_queue_depth gauge
gpu_asgi_queue_depth 2.0
# TYPE gpu_asgi_reserved_bytes gauge
gpu_asgi_reserved_bytes{device="cuda:0"} 100.0
gpu_asgi_reserved_bytes{device="cuda:1"} 50.0
# TYPE gpu_asgi_capacity_bytes gauge
gpu_asgi_capacity_bytes{device="cuda:0"} 1000.0
# TYPE gpu_asgi_in_flight_requests gauge
gpu_asgi_in_flight_requests{device="cuda:0"} 3.0
"""
PNG = b"\x89PNG\r\n\x1a\n"


def busy_once_app() -> Starlette:
    """Answers each prompt's first attempt with 503 + Retry-After: 1, and the next with 200."""
    seen: set[str] = set()

    async def generate(request: Request) -> Response:
        prompt = (await request.json())["prompt"]
        if prompt not in seen:
            seen.add(prompt)
            headers = {"retry-after": "1", "x-gpu-admission-reason": "queue-full"}
            return JSONResponse(
                {"type": "urn:gpu-asgi:problem:queue-full"}, 503, headers, media_type="application/problem+json"
            )
        return JSONResponse({"text": "ok", "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(METRICS)

    return Starlette(routes=[Route("/v1/generate", generate, methods=["POST"]), Route("/metrics", metrics)])


@asynccontextmanager
async def serve(app: Starlette) -> AsyncIterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    task = asyncio.ensure_future(server.serve())
    await wait_until(lambda: server.started)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)


def config(url: str, **values: object) -> LoadTestConfig:
    base = {"url": url, "endpoint": "generate", "clients": 3, "requests": 6, "progress": False, "metrics_interval": 0.1}
    return LoadTestConfig(**{**base, **values})  # type: ignore[arg-type]


async def test_retry_after_is_honoured_when_asked() -> None:
    async with serve(busy_once_app()) as url:
        patient = await run_load(config(url, honour_retry_after=True))
        impatient = await run_load(config(url, seed=1))  # new prompts: each is refused once
    summary = summarize(patient)
    assert summary["requests"]["succeeded"] == 6 and summary["requests"]["retries"] == 6
    assert summary["requests"]["status_counts"] == {"200": 6, "503": 6}
    assert summary["requests"]["rejections_by_reason"] == {"queue-full": 6}
    for record in patient.records:  # waited the server's Retry-After before trying again
        first, second = record.attempts
        assert second.started - first.finished >= 1.0
    assert summary["latency_seconds"]["p50"] >= 1.0
    assert summary["timeline"]["queue_depth"][0] == 2.0 and summary["timeline"]["reserved_bytes"][0] == 150.0
    refused = summarize(impatient)["requests"]
    assert (refused["succeeded"], refused["rejected"], refused["retries"]) == (0, 6, 0)


async def test_against_the_demo_with_report_and_plots(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from ._demo import loaded_model, model_dir, serving

    model = loaded_model(model_dir(tmp_path_factory))
    async with serving(model) as (app, port):
        result = await run_load(
            config(f"http://127.0.0.1:{port}", endpoint="chat", stream=True, clients=4, requests=8, max_tokens=4)
        )
    summary = summarize(result)
    assert summary["requests"]["succeeded"] == 8, summary["requests"]
    assert summary["throughput"]["completion_tokens"] == 32
    assert summary["time_to_first_token_seconds"]["p50"] is not None
    assert max(summary["timeline"]["capacity_bytes"]) == app.state.service.ledger.capacity("cpu")
    assert max(summary["timeline"]["reserved_bytes"]) > 0  # seen while requests ran
    paths = write_plots(summary, tmp_path)
    assert sorted(p.name for p in paths) == ["latency.png", "ledger.png", "rejections.png", "throughput.png"]
    assert all(p.read_bytes().startswith(PNG) for p in paths)


async def test_the_command_line_writes_report_and_plots(tmp_path: Path) -> None:
    async with serve(busy_once_app()) as url:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "demo_service.loadtest",
            "--url",
            url,
            "--endpoint",
            "generate",
            "--clients",
            "2",
            "--requests",
            "4",
            "--honour-retry-after",
            "--out",
            str(tmp_path),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["requests"]["succeeded"] == 4 and report["config"]["honour_retry_after"] is True
    assert {p.name for p in tmp_path.glob("*.png")} == {"latency.png", "ledger.png", "rejections.png", "throughput.png"}
    assert "requests" in err.decode()  # the progress bar (on stderr)


def test_retry_after_parsing() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 <= parse_retry_after(later) <= 31  # type: ignore[operator]


def test_workload_mix_and_metrics_parsing() -> None:
    jobs = make_jobs(300, endpoint="chat", seed=3)
    assert jobs == make_jobs(300, endpoint="chat", seed=3)  # repeatable
    shares = {name: sum(j.length_class == name for j in jobs) / len(jobs) for name in ("short", "medium", "long")}
    assert shares["short"] > shares["medium"] > shares["long"] > 0
    assert {c.name for c in parse_mix("long:1")} == {"long"}
    with pytest.raises(ValueError):
        parse_mix("huge:1")
    assert parse_gauges(METRICS) == {
        "queue_depth": 2.0,
        "reserved_bytes": 150.0,
        "capacity_bytes": 1000.0,
        "in_flight": 3.0,
    }
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 50) is None


def test_the_locustfile_needs_nothing_but_locust() -> None:
    # docs/load-testing.md installs only locust: the locustfile must not pull in the load tester's
    # own dependencies (httpx, tqdm, prometheus-client, matplotlib) nor the demo's.
    if importlib.util.find_spec("locust") is None:  # not imported here: it monkey-patches the process (gevent)
        pytest.skip("locust is not installed")
    script = (
        "import importlib.abc, runpy, sys\n"
        "BLOCKED = {'httpx', 'tqdm', 'prometheus_client', 'matplotlib', 'torch', 'transformers', 'fastapi', 'pydantic'}\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "namespace = runpy.run_path('demo_service/loadtest/locustfile.py')\n"
        "user = namespace['ChatUser']\n"
        "print('ok', user.__name__, len(namespace['_JOBS']))\n"
    )
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok ChatUser 1000")
