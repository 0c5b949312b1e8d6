"""gpu_asgi.vllm without vLLM: its settings, what it learns from a vLLM-shaped ``app.state``, and
admission through a FastAPI app laid out as vLLM's (its auth middleware inside ours, its routes).
The real server is tested in tests/vllm/ (its own venv)."""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, generate_latest
from starlette.responses import JSONResponse

from gpu_asgi import TenantKey
from gpu_asgi.vllm import ServerNotReady, SettingsError, VLLMAdmission, VLLMSettings, budget_for, learn

KV_BYTES_PER_TOKEN = 4096  # 2 x 4 layers x 2 KV heads x 64 dims x 4 bytes (float32)
BLOCK = 128
API_KEY = "sk-right"


@functools.cache
def qwen_tokenizer() -> Any:
    """The demo model's tokenizer (Qwen's vocabulary, ChatML template), built locally."""
    from demo_service._model.local import _build_tokenizer

    return _build_tokenizer()


def vllm_state(*, num_blocks: int = 16, cache_dtype: str = "auto", tokenizer: Any = None, **model: Any) -> Any:
    """What vLLM's ``init_app_state`` leaves in ``app.state``, as far as gpu_asgi reads it."""
    parallel = SimpleNamespace(data_parallel_size=1)
    model_config = SimpleNamespace(
        dtype=model.get("dtype", "torch.float32"),
        max_model_len=model.get("max_model_len", 1024),
        served_model_name="tiny",
        model="/models/tiny",
        get_num_layers=lambda p: 4,
        get_num_kv_heads=lambda p: 2,
        get_head_size=lambda: 64,
    )
    cache = SimpleNamespace(
        num_gpu_blocks=num_blocks, block_size=BLOCK, cache_dtype=cache_dtype, enable_prefix_caching=True
    )
    renderer = SimpleNamespace(get_tokenizer=lambda: tokenizer or qwen_tokenizer())
    return SimpleNamespace(
        vllm_config=SimpleNamespace(cache_config=cache, model_config=model_config, parallel_config=parallel),
        engine_client=SimpleNamespace(renderer=renderer),
        online_renderer=SimpleNamespace(chat_template=None, default_chat_template_kwargs={}),
    )


# -- settings ----------------------------------------------------------------------


def test_settings_default_and_parse() -> None:
    assert VLLMSettings.from_env({}) == VLLMSettings()
    settings = VLLMSettings.from_env({
        "GPU_ASGI_MAX_WAIT": "2.5", "GPU_ASGI_MAX_QUEUE": "10", "GPU_ASGI_REJECT_STATUS": "429",
        "GPU_ASGI_TENANT_KEY": "api-key, header:x-team", "GPU_ASGI_TENANT_WEIGHTS": "gold=4,key-abc=0.5",
        "GPU_ASGI_LEDGER_URL": "redis://127.0.0.1:6379/0", "GPU_ASGI_LEDGER_NAMESPACE": "gpu0",
        "GPU_ASGI_OVERSUBSCRIBE": "1.5", "GPU_ASGI_REDIS_TIMEOUT": "5", "GPUASGI_TEST_BUDGET": "other tests' own",
        "PATH": "/bin",
    })
    assert settings.redis_timeout == 5.0
    assert (settings.max_wait, settings.max_queue, settings.reject_status) == (2.5, 10, 429)
    assert settings.tenant_key == (TenantKey.api_key(), TenantKey.header("x-team"))
    assert settings.tenant_weights == {"gold": 4.0, "key-abc": 0.5}
    assert settings.tenant_policies()["gold"].weight == 4.0
    assert (settings.ledger_url, settings.namespace, settings.oversubscribe) == ("redis://127.0.0.1:6379/0", "gpu0", 1.5)
    assert VLLMSettings.from_env({"GPU_ASGI_LEDGER_URL": "memory://"}).ledger_url is None
    sentinel = "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/gpu/0"  # docs/deployment.md, "Failover"
    assert VLLMSettings.from_env({"GPU_ASGI_LEDGER_URL": sentinel}).ledger_url == sentinel
    assert VLLMSettings().quantile == 0.5  # learned lengths by default
    for text, quantile in (("strict", None), ("STRICT", None), ("learned", 0.5), ("0.75", 0.75), ("1", 1.0)):
        assert VLLMSettings.from_env({"GPU_ASGI_RESERVE": text}).quantile == quantile
    assert VLLMSettings().growth == 0.99  # following holds the 0.99 quantile of the growth by default
    for text, growth in (("all", None), ("ALL", None), ("0.99", 0.99)):
        assert VLLMSettings.from_env({"GPU_ASGI_GROWTH": text}).growth == growth


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"GPU_ASGI_MAX_WAITS": "3"}, "unknown setting GPU_ASGI_MAX_WAITS"),
        ({"GPU_ASGI_TEST_BUDGET": "1"}, "unknown setting GPU_ASGI_TEST_BUDGET"),  # no name is exempt
        ({"GPU_ASGI_MAX_WAIT": "soon"}, "GPU_ASGI_MAX_WAIT='soon': expected seconds"),
        ({"GPU_ASGI_MAX_WAIT": "0"}, "GPU_ASGI_MAX_WAIT"),
        ({"GPU_ASGI_MAX_QUEUE": "1.5"}, "GPU_ASGI_MAX_QUEUE"),
        ({"GPU_ASGI_REJECT_STATUS": "500"}, "expected 429 or 503"),
        ({"GPU_ASGI_TENANT_KEY": "cookie"}, "'cookie' is not api-key"),
        ({"GPU_ASGI_TENANT_WEIGHTS": "gold=-1"}, "'gold=-1' is not name=weight"),
        ({"GPU_ASGI_TENANT_WEIGHTS": "gold"}, "GPU_ASGI_TENANT_WEIGHTS"),
        ({"GPU_ASGI_LEDGER_URL": "http://redis"}, "expected redis://"),
        ({"GPU_ASGI_OVERSUBSCRIBE": "9"}, "a factor from 0.1 to 4"),
        ({"GPU_ASGI_OVERSUBSCRIBE": "nan"}, "GPU_ASGI_OVERSUBSCRIBE"),
        ({"GPU_ASGI_REDIS_TIMEOUT": "0"}, "GPU_ASGI_REDIS_TIMEOUT"),
        ({"GPU_ASGI_RESERVE": "0"}, "expected strict, learned or a quantile"),
        ({"GPU_ASGI_RESERVE": "1.5"}, "GPU_ASGI_RESERVE"),
        ({"GPU_ASGI_RESERVE": "worst"}, "GPU_ASGI_RESERVE"),
        ({"GPU_ASGI_GROWTH": "1"}, "expected all or a quantile in (0, 1)"),
        ({"GPU_ASGI_GROWTH": "most"}, "GPU_ASGI_GROWTH"),
    ],
)
def test_settings_refuse_what_they_cannot_use(environ: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        VLLMSettings.from_env(environ)


# -- what is learnt from the server ---------------------------------------------------


def test_learns_the_kv_cache_and_sizes_the_budget() -> None:
    server = learn(vllm_state())
    assert (server.num_blocks, server.usable_blocks, server.block_size) == (16, 15, BLOCK)
    assert (server.kv_dtype, server.kv_bytes_per_token, server.max_model_len) == ("float32", KV_BYTES_PER_TOKEN, 1024)
    assert budget_for(server, 1.0) == 15 * BLOCK * KV_BYTES_PER_TOKEN
    assert budget_for(server, 1.5) == 22 * BLOCK * KV_BYTES_PER_TOKEN  # whole blocks
    assert learn(vllm_state(cache_dtype="fp8")).kv_bytes_per_token == KV_BYTES_PER_TOKEN // 4
    assert learn(vllm_state(dtype="torch.bfloat16")).kv_bytes_per_token == KV_BYTES_PER_TOKEN // 2


def test_refuses_a_server_it_cannot_read() -> None:
    with pytest.raises(ServerNotReady, match="no vLLM engine"):
        learn(SimpleNamespace())
    with pytest.raises(ServerNotReady, match="no usable KV cache"):
        learn(vllm_state(num_blocks=None))
    with pytest.raises(ServerNotReady, match="dtype 'int4'"):
        learn(vllm_state(cache_dtype="int4"))


# -- admission through a vLLM-shaped app ----------------------------------------------


class ApiKeyCheck:
    """vLLM's AuthenticationMiddleware in miniature: /v1 needs the key; answers before routing."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            if headers.get(b"authorization") != f"Bearer {API_KEY}".encode():
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def vllm_like_app(state: Any, environ: Mapping[str, str], registry: Any, hold: asyncio.Event) -> FastAPI:
    app = FastAPI()
    for name, value in vars(state).items():
        setattr(app.state, name, value)

    def admitted(request: Request) -> dict[str, Any]:
        admission = getattr(request.state, "gpu_admission", None)
        if admission is None:
            return {"admitted": False}
        return {"admitted": True, "prompt_tokens": admission.prompt_tokens, "max_new_tokens": admission.max_new_tokens,
                "batch": admission.batch, "bytes": admission.estimated_bytes, "tenant": admission.tenant}

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any], request: Request) -> dict[str, Any]:
        if body.get("hold"):
            await hold.wait()
        answer = admitted(request)
        if "answer_tokens" in body:  # what vLLM's answer says it generated
            answer["usage"] = {"completion_tokens": body["answer_tokens"]}
        return answer

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any], request: Request) -> dict[str, Any]:
        return admitted(request)

    @app.post("/v1/responses")
    async def responses(body: dict[str, Any], request: Request) -> dict[str, Any]:
        return admitted(request)

    @app.post("/v1/embeddings")
    async def embeddings(body: dict[str, Any], request: Request) -> dict[str, Any]:
        return admitted(request)

    app.add_middleware(ApiKeyCheck)  # vLLM adds its own middleware first: ours is outermost
    app.add_middleware(VLLMAdmission, environ=environ, registry=registry)
    return app


@asynccontextmanager
async def served(environ: Mapping[str, str] | None = None, **state: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Any, asyncio.Event]]:
    registry, hold = CollectorRegistry(), asyncio.Event()
    app = vllm_like_app(vllm_state(**state), {"GPU_ASGI_MAX_WAIT": "0.2", **(environ or {})}, registry, hold)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=transport, base_url="http://vllm", headers={"authorization": f"Bearer {API_KEY}"}
    ) as client:
        try:
            yield client, registry, hold
        finally:
            hold.set()


async def test_counts_exactly_what_vllm_tokenizes() -> None:
    tokenizer = qwen_tokenizer()
    messages = [{"role": "user", "content": "Hello there, how are you?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Fine."}, {"type": "text", "text": "You?"}]},
                {"role": "user", "content": "Count 12345."}]
    flat = [{**m, "content": "Fine.\nYou?"} if m["role"] == "assistant" else m for m in messages]
    rendered = tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    expected_chat = len(tokenizer.encode(rendered, add_special_tokens=False))
    async with served() as (client, _, _):
        chat = (await client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 50})).json()
        assert chat == {"admitted": True, "prompt_tokens": expected_chat, "max_new_tokens": 50, "batch": 1,
                        "bytes": -(-(expected_chat + 50) // BLOCK) * BLOCK * KV_BYTES_PER_TOKEN, "tenant": "default"}
        text = "The quick brown fox jumps over the lazy dog 2024 times."
        completion = (await client.post("/v1/completions", json={"prompt": [text, "Hi"], "max_tokens": 100, "n": 2})).json()
        assert completion["prompt_tokens"] == len(tokenizer.encode(text))  # the longer prompt
        ids = (await client.post("/v1/completions", json={"prompt": [[1, 2, 3], [4]], "max_tokens": 1})).json()
        assert (ids["prompt_tokens"], ids["batch"]) == (3, 2)
        assert (completion["batch"], completion["bytes"]) == (4, 4 * BLOCK * KV_BYTES_PER_TOKEN)
        # No max_tokens, and vLLM's request model is not importable here: max_model_len, the most it could be.
        unset = (await client.post("/v1/completions", json={"prompt": text})).json()
        assert unset["bytes"] == 1024 // BLOCK * BLOCK * KV_BYTES_PER_TOKEN
        # Responses: instructions as the system message, then the input, through the template.
        answer = (await client.post("/v1/responses", json={"input": "Say hi.", "instructions": "Be brief.",
                                                            "max_output_tokens": 7})).json()
        rendered = tokenizer.apply_chat_template(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
            tokenize=False, add_generation_prompt=True,
        )
        assert (answer["prompt_tokens"], answer["max_new_tokens"]) == (len(tokenizer.encode(rendered)), 7)
        # Other routes pass through, unadmitted.
        assert (await client.post("/v1/embeddings", json={"input": "x"})).json() == {"admitted": False}


async def test_refusals_are_openai_errors_with_retry_after_and_wrong_keys_get_401_at_once() -> None:
    async with served({"GPU_ASGI_REJECT_STATUS": "429"}) as (client, registry, hold):
        # 7 x 2 blocks of the 15 usable: the cache is full (an eighth would need a 16th block).
        holders = [asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 199, "hold": True}))
                   for _ in range(7)]
        await asyncio.sleep(0.3)
        refused = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 199})
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_exceeded", "queue-timeout")
        loop = asyncio.get_running_loop()
        started = loop.time()
        unauthorized = await client.post("/v1/completions", json={"prompt": "x"}, headers={"authorization": "Bearer wrong"})
        assert unauthorized.status_code == 401
        assert loop.time() - started < 0.15  # under GPU_ASGI_MAX_WAIT: it never queued
        metrics = generate_latest(registry).decode()
        assert "gpu_asgi_in_flight_requests" in metrics and "gpu_asgi_rejected_total" in metrics
        hold.set()
        assert [r.status_code for r in await asyncio.gather(*holders)] == [200] * 7


async def test_tenants_from_the_settings() -> None:
    async with served({"GPU_ASGI_TENANT_KEY": "header:x-team"}) as (client, _, _):
        answer = (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"x-team": "blue"})).json()
        assert answer["tenant"] == "blue"


@pytest.mark.parametrize(
    ("environ", "state", "message"),
    [
        ({"GPU_ASGI_QUEUE": "3"}, {}, "unknown setting GPU_ASGI_QUEUE"),
        ({}, {"num_blocks": 1}, "no usable KV cache"),
    ],
)
async def test_startup_fails_with_the_reason(environ: dict[str, str], state: dict[str, Any], message: str) -> None:
    app = vllm_like_app(vllm_state(**state), environ, CollectorRegistry(), asyncio.Event())
    messages: list[dict[str, Any]] = []
    incoming = iter([{"type": "lifespan.startup"}])

    async def receive() -> dict[str, Any]:
        return next(incoming)

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    with pytest.raises(RuntimeError, match=message):
        await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    assert messages[0]["type"] == "lifespan.startup.failed"
    assert message in messages[0]["message"]
    assert json.dumps(messages)  # a plain message a server can log


async def test_tags_an_alias_and_leaves_the_endpoint_function_alone() -> None:
    """The route's endpoint is replaced by a tagged alias; the function itself (shared by every app
    in the process, as vLLM's module-level endpoints are) carries no tag."""
    from gpu_asgi._asgi.routes import route_spec_of

    app = vllm_like_app(vllm_state(), {}, CollectorRegistry(), asyncio.Event())
    route = next(r for r in app.routes if getattr(r, "path", "") == "/v1/completions")
    original = route.endpoint
    sent: list[Any] = []
    await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, _startup_then_shutdown(), _collect(sent))
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert route.endpoint is not original and route.endpoint.__name__ == original.__name__
    assert route_spec_of(route.endpoint, "POST") is not None
    assert route_spec_of(original, "POST") is None
    embeddings = next(r for r in app.routes if getattr(r, "path", "") == "/v1/embeddings")
    assert route_spec_of(embeddings.endpoint, "POST") is None


def _startup_then_shutdown() -> Any:
    messages = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])

    async def receive() -> dict[str, Any]:
        return next(messages)

    return receive


def _collect(sent: list[Any]) -> Any:
    async def send(message: Any) -> None:
        sent.append(message)

    return send


# -- learned lengths and the closed loop on vLLM's KV-cache usage -----------------------------


async def test_a_completion_without_max_tokens_is_reserved_what_vllm_generates(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CompletionRequest defaults max_tokens to 16 (a null too): that, read from vLLM's own
    model, is what a completion without one is reserved, not max_model_len; a chat without one
    may run to max_model_len. Where vLLM's model cannot be read, max_model_len (never too little)."""
    import types

    from pydantic import BaseModel

    from gpu_asgi._vllm.routes import completion_default_max_tokens

    assert completion_default_max_tokens(1024) == 1024  # no vllm in this venv: the safe side

    class CompletionRequest(BaseModel):
        max_tokens: int | None = 16

    names = ("vllm", "vllm.entrypoints", "vllm.entrypoints.openai", "vllm.entrypoints.openai.completion")
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    protocol = types.ModuleType("vllm.entrypoints.openai.completion.protocol")
    protocol.CompletionRequest = CompletionRequest  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, protocol.__name__, protocol)
    assert completion_default_max_tokens(1024) == 16 and completion_default_max_tokens(8) == 8

    blocks = lambda tokens: -(-tokens // BLOCK) * BLOCK * KV_BYTES_PER_TOKEN  # noqa: E731
    async with served({"GPU_ASGI_RESERVE": "strict"}) as (client, _, _):
        for body in ({"prompt": "x"}, {"prompt": "x", "max_tokens": None}):
            answer = (await client.post("/v1/completions", json=body)).json()
            assert (answer["max_new_tokens"], answer["bytes"]) == (16, blocks(1 + 16))
        chat = (await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})).json()
        assert chat["max_new_tokens"] == 1024  # the state's max_model_len


async def test_learned_lengths_are_the_default_and_strict_stays_a_setting() -> None:
    blocks = lambda tokens: -(-tokens // BLOCK) * BLOCK * KV_BYTES_PER_TOKEN  # noqa: E731
    request = {"prompt": "x", "max_tokens": 600, "answer_tokens": 40}
    for environ, warm in (({}, blocks(1 + 40)), ({"GPU_ASGI_RESERVE": "strict"}, blocks(1 + 600))):
        async with served(environ) as (client, _, _):
            reserved = [(await client.post("/v1/completions", json=request)).json()["bytes"] for _ in range(17)]
        assert reserved[:16] == [blocks(1 + 600)] * 16  # cold: nothing learnt yet, the worst case
        assert reserved[16] == warm  # 16 answers of 40 tokens: one block, unless strict


@asynccontextmanager
async def started_and_stopped(environ: Mapping[str, str]) -> AsyncIterator[httpx.AsyncClient]:
    """A vLLM-like app whose lifespan runs through the middleware, as a server runs it: started
    before the client's requests, shut down after them."""
    app = vllm_like_app(vllm_state(), {"GPU_ASGI_MAX_WAIT": "0.2", **environ}, CollectorRegistry(), asyncio.Event())
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    lifespan = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get, sent.put))
    await inbox.put({"type": "lifespan.startup"})
    assert (await sent.get())["type"] == "lifespan.startup.complete"
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://vllm", headers={"authorization": f"Bearer {API_KEY}"}
    ) as client:
        yield client
    await inbox.put({"type": "lifespan.shutdown"})
    assert (await sent.get())["type"] == "lifespan.shutdown.complete"
    await lifespan


async def test_a_restarted_server_starts_warm_from_its_lengths_file(tmp_path: Path) -> None:
    """GPU_ASGI_LENGTHS_FILE: the first server learns 16 answers and saves them at shutdown; the
    next one (a restart) reserves the learnt length from its first request. A file written for
    another model is ignored: that server starts cold."""
    blocks = lambda tokens: -(-tokens // BLOCK) * BLOCK * KV_BYTES_PER_TOKEN  # noqa: E731
    request = {"prompt": "x", "max_tokens": 600, "answer_tokens": 40}
    path = tmp_path / "lengths.json"
    environ = {"GPU_ASGI_LENGTHS_FILE": str(path)}
    async with started_and_stopped(environ) as client:
        first = [(await client.post("/v1/completions", json=request)).json()["bytes"] for _ in range(16)]
    assert first == [blocks(1 + 600)] * 16  # cold
    async with started_and_stopped(environ) as client:
        assert (await client.post("/v1/completions", json=request)).json()["bytes"] == blocks(1 + 40)  # warm
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "model": "another (max_model_len 1024)"}))
    async with started_and_stopped(environ) as client:
        assert (await client.post("/v1/completions", json=request)).json()["bytes"] == blocks(1 + 600)  # cold again


def usage_registry(value: float) -> tuple[CollectorRegistry, Any]:
    from prometheus_client import Gauge

    registry = CollectorRegistry()
    gauge = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage", ["engine", "model_name"], registry=registry)
    gauge.labels(engine="0", model_name="tiny").set(value)
    return registry, gauge.labels(engine="0", model_name="tiny")


async def test_the_cache_holding_more_than_was_reserved_is_corrected_into_the_ledger() -> None:
    from gpu_asgi import Ledger
    from gpu_asgi._vllm.engine_usage import ENGINE_TENANT, EngineUsage

    block = BLOCK * KV_BYTES_PER_TOKEN
    ledger = Ledger(15 * block)
    registry, usage = usage_registry(0.0)
    loop = EngineUsage(ledger, registry, cache_bytes=15 * block, block_bytes=block)
    await loop.correct()
    assert loop.correction is not None and loop.correction.nbytes == 0 and loop.correction.tenant == ENGINE_TENANT
    client = await ledger.reserve(2 * block)  # reserved 2 blocks; its answer grew inside vLLM to 5
    usage.set(5 / 15)
    await loop.correct()
    assert loop.correction.nbytes == 3 * block
    assert ledger.statistics().reserved_bytes == 5 * block
    usage.set(15.5 / 15)  # past the budget (over-subscribed): nobody new until it is back under
    await loop.correct()
    assert ledger.statistics().reserved_bytes == 16 * block and ledger.try_reserve(0) is None
    usage.set(1 / 15)  # less used than reserved: nothing to correct
    await loop.correct()
    assert loop.correction.nbytes == 0
    client.release()
    await loop.stop()
    assert ledger.statistics().reserved_bytes == 0 and ledger.statistics().in_flight == 0


async def test_the_closed_loop_runs_beside_learned_lengths_only() -> None:
    from gpu_asgi._vllm.middleware import build

    def vllm_app() -> FastAPI:
        app = FastAPI()
        for name, value in vars(vllm_state()).items():
            setattr(app.state, name, value)

        @app.post("/v1/completions")
        async def completions(body: dict[str, Any]) -> dict[str, Any]:
            return body

        return app

    registry, _ = usage_registry(0.0)
    learned, strict = vllm_app(), vllm_app()
    assert build(learned, learned, {}, registry)[1] is not None
    assert build(strict, strict, {"GPU_ASGI_RESERVE": "strict"}, CollectorRegistry())[1] is None
