"""The demo's OpenAPI schema tells the truth: schemathesis finds nothing, and the limits are declared.

What the schema allows is served, and what it calls invalid is refused with a 422 problem (the
request models are as strict as the schema: no ``0`` for a boolean, no ``false`` for a number).
The demo runs on the tiny CPU model behind a real uvicorn (in a thread: schemathesis calls it
synchronously), with a small ``max_tokens`` cap so each generated request costs milliseconds.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
schemathesis = pytest.importorskip("schemathesis")

import uvicorn  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from demo_service import LoadedModel, create_app  # noqa: E402

from ._asgi import client  # noqa: E402
from ._demo import ledger_of, loaded_model, model_dir, running  # noqa: E402
from ._demo import settings as demo_settings  # noqa: E402

CAP = 4
#: Examples per operation, derandomized so a failure reproduces. 20 is the smallest that still
#: catches the subtlest mismatch the schema had (a 5-item ``stop`` list; 10 missed it): about
#: 20-40 s here, the slowest module of the default run.
EXAMPLES = 20
PROBLEM = "application/problem+json"
CHAT = [{"role": "user", "content": "hi"}]
#: schemathesis' check that the server refuses what the schema calls invalid (``negative_data_rejection``:
#: it counted the bodies answered 200 in issue 24) and its mirror (``positive_data_acceptance``). The
#: coverage phase, negative mode only, sends each field with a value of each wrong type: a fixed set
#: of cases, where those findings came from, each answered fast (refused before the model runs).
#: Fuzzing adds a bounded, deterministic run of valid and invalid bodies.
STRICTNESS = """
workers = 1
seed = 24
continue-on-failure = true

[generation]
mode = "all"
max-examples = 10
deterministic = true
database = "none"

[phases.examples]
enabled = false

[phases.coverage.generation]
mode = "negative"

[phases.stateful]
enabled = false

[checks]
enabled = false
negative_data_rejection.enabled = true
positive_data_acceptance.enabled = true
not_a_server_error.enabled = true
"""


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


def test_schemathesis_finds_no_invalid_body_accepted_and_no_valid_one_refused(base_url: str, tmp_path: Path) -> None:
    # Its command line, as a user runs it (its pytest plugin's lazy schemas do not run under pytest 9).
    config = tmp_path / "schemathesis.toml"
    config.write_text(STRICTNESS)
    command = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color", "run"]
    run = subprocess.run(
        [*command, f"{base_url}/openapi.json"], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    cases = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
    assert cases is not None and cases[1] == cases[2] and int(cases[1]) > 100, run.stdout[-2000:]


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


def _body_validator(spec: dict[str, Any], path: str) -> Any:
    """The served schema's check of ``path``'s request body (OpenAPI 3.1 schemas are JSON Schema 2020-12)."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")  # schemathesis' own validator
    body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema_rs.Draft202012Validator({**body, "components": spec["components"]})


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        # The three issue 24 names: each was answered 200.
        ("/v1/completions", {"prompt": "hi", "echo": 0}, "echo"),
        ("/v1/generate", {"prompt": "hi", "temperature": False}, "temperature"),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": {}}, "tool_choice"),
        # More of the same kinds: a number for a boolean, a boolean or a string for a number or an
        # integer, a value the schema does not declare where only null is.
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": 5}, "tool_choice"),
        ("/v1/chat/completions", {"messages": CHAT, "stream": 0}, "stream"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": 0}, "logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": False}, "presence_penalty"),
        ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"7": True}}, "logit_bias.7"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": 0}}, "stream_options.include_usage"),
        ("/v1/completions", {"prompt": "hi", "seed": False}, "seed"),
        ("/v1/completions", {"prompt": "hi", "best_of": True}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature"),
        ("/v1/generate", {"prompt": "hi", "top_p": "1"}, "top_p"),
    ],
)
async def test_what_the_schema_calls_invalid_gets_the_validation_problem(
    model: LoadedModel, path: str, body: dict[str, Any], field: str
) -> None:
    async with running(model, max_new_tokens_cap=CAP, default_max_new_tokens=2) as app, client(app) as http:
        assert not _body_validator(app.openapi(), path).is_valid(body)  # the schema's own verdict
        response = await http.post(path, json=body)
        assert ledger_of(app).statistics().reserved_bytes == 0
    assert response.status_code == 422 and response.headers["content-type"] == PROBLEM
    problem = response.json()
    assert problem["type"] == "urn:demo-service:problem:invalid-request" and problem["status"] == 422
    assert problem["errors"][0]["field"].startswith(field) and problem["detail"].startswith(field)
    if path != "/v1/generate":  # OpenAI's error object names the parameter, which the SDKs show
        assert problem["error"]["param"].startswith(field)


async def test_unsupported_parameters_say_which_value_is_accepted(model: LoadedModel) -> None:
    async with running(model, max_new_tokens_cap=CAP, default_max_new_tokens=2) as _app, client(_app) as http:
        tools = await http.post("/v1/chat/completions", json={"messages": CHAT, "tool_choice": "auto"})
        bias = await http.post("/v1/completions", json={"prompt": "hi", "logit_bias": {"7": 1.5}})
    assert tools.status_code == 422 and tools.json()["error"]["param"] == "tool_choice"
    assert "'tool_choice' is not supported by this server: only null (got \"auto\")" in tools.json()["detail"]
    assert bias.status_code == 422 and "only null or {}" in bias.json()["detail"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # JSON Schema's number includes integers, its integer includes 2.0; the neutral values in
        # each spelling the schema allows.
        (
            "/v1/completions",
            {
                "prompt": [1, 2.0],
                "temperature": 0,
                "top_p": 1,
                "n": 2.0,
                "max_tokens": 2.0,
                "seed": 7.0,
                "presence_penalty": 0,
                "frequency_penalty": 0.0,
                "logit_bias": {},
                "echo": False,
                "best_of": 1.0,
                "logprobs": None,
                "suffix": None,
                "stream": False,
                "stream_options": {"include_usage": True},
            },
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "temperature": 1,
                "max_completion_tokens": 2.0,
                "logprobs": False,
                "top_logprobs": None,
                "tools": None,
                "tool_choice": None,
                "logit_bias": None,
                "response_format": {"type": "text"},
            },
        ),
        ("/v1/generate", {"prompt": "hi", "max_new_tokens": 2.0, "temperature": 1, "top_p": 1, "stop": ["."]}),
    ],
)
async def test_what_the_schema_allows_is_served(model: LoadedModel, path: str, body: dict[str, Any]) -> None:
    async with running(model, max_new_tokens_cap=CAP, default_max_new_tokens=2) as app, client(app) as http:
        assert _body_validator(app.openapi(), path).is_valid(body)
        response = await http.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
