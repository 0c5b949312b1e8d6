"""The demo's OpenAPI schema tells the truth: schemathesis finds nothing, and the limits are declared.

The demo runs on the tiny CPU model behind a real uvicorn (in a thread: schemathesis calls it
synchronously), with a small ``max_tokens`` cap so each generated request costs milliseconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
schemathesis = pytest.importorskip("schemathesis")

import uvicorn  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from demo_service import LoadedModel, create_app  # noqa: E402

from ._asgi import client  # noqa: E402
from ._demo import loaded_model, model_dir, running  # noqa: E402
from ._demo import settings as demo_settings  # noqa: E402

CAP = 4
#: Examples per operation, derandomized so a failure reproduces. 20 is the smallest that still
#: catches the subtlest mismatch the schema had (a 5-item ``stop`` list; 10 missed it): about
#: 20-40 s here, the slowest module of the default run.
EXAMPLES = 20
PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return loaded_model(model_dir(tmp_path_factory))


@pytest.fixture(scope="module")
def base_url(model: LoadedModel) -> Iterator[str]:
    app = create_app(demo_settings(max_new_tokens_cap=CAP, default_max_new_tokens=2, batch_window_ms=0), model=model)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="demo-under-schemathesis", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the demo did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)


def test_schemathesis_finds_nothing(base_url: str) -> None:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} == {
        "POST /v1/generate",
        "GET /v1/models",
        "POST /v1/completions",
        "POST /v1/chat/completions",
    }
    for operation in operations:

        @given(operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: Any) -> None:
            case.call_and_validate(base_url=base_url, timeout=60)  # every default check

        check()


async def test_the_schema_declares_the_admission_errors_and_limits(model: LoadedModel) -> None:
    app = create_app(demo_settings(max_new_tokens_cap=CAP, default_max_new_tokens=2), model=model)
    spec = app.openapi()
    schemas = spec["components"]["schemas"]
    for path in ("/v1/generate", "/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        for status in ("400", "413", "415", "422", "429", "503"):
            problem = responses[status]["content"][PROBLEM]["schema"]
            assert {"type", "title", "status", "detail"} <= set(problem["required"]), (path, status)
            assert ("error" in problem["properties"]) == (path != "/v1/generate"), (path, status)
        for status in ("429", "503"):
            assert "Retry-After" in responses[status]["headers"], (path, status)
    assert schemas["GenerateRequest"]["properties"]["max_new_tokens"]["anyOf"][0]["maximum"] == CAP
    for name, field in (("CompletionRequest", "max_tokens"), ("ChatRequest", "max_completion_tokens")):
        assert schemas[name]["properties"][field]["anyOf"][0]["maximum"] == CAP
        assert schemas[name]["properties"]["n"]["maximum"] == 8
    assert schemas["ChatRequest"]["properties"]["tools"]["enum"] == [None]  # refused unless null


async def test_integers_written_as_floats_and_tiny_temperatures_are_served(model: LoadedModel) -> None:
    # Found by schemathesis: JSON Schema's integer includes 2.0 (gpu_asgi refused it with 422), and
    # a temperature of 6e-55 overflowed the logits (500).
    async with running(model, max_new_tokens_cap=CAP, default_max_new_tokens=2) as app, client(app) as http:
        floats = await http.post("/v1/completions", json={"prompt": [1.0, 2.0], "max_tokens": 2.0, "n": 1.0})
        tiny = await http.post("/v1/generate", json={"prompt": "hi", "max_new_tokens": 2, "temperature": 6e-55})
    assert floats.status_code == 200 and floats.json()["usage"]["completion_tokens"] == 2
    assert tiny.status_code == 200 and tiny.json()["usage"]["completion_tokens"] == 2
