"""The demo's lifecycle: not ready until its model has loaded and one real warm-up generation has
run; a non-streaming request whose client leaves is cancelled, and its bytes come back once its
batch has left the device."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

import pytest

from demo_service import LoadedModel, create_app
from demo_service._batching import batcher as batcher_module

from ._asgi import client, wait_until
from ._demo import batcher_of, bytes_back_after_the_batch, ledger_of, loaded_model, model_dir, serving, settings


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return loaded_model(model_dir(tmp_path_factory))


async def test_not_ready_until_the_warm_up_generation_has_run(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gate, calls = threading.Event(), []
    real_run_batch = batcher_module.run_batch

    def held_run_batch(*args: Any) -> int:  # on the device thread: the warm-up waits for the gate
        gate.wait(30)
        calls.append(args[1])
        return real_run_batch(*args)

    monkeypatch.setattr(batcher_module, "run_batch", held_run_batch)
    caplog.set_level(logging.INFO, logger="demo_service")
    app = create_app(settings(), model=model)
    async with app.router.lifespan_context(app), client(app) as http:
        live = await http.get("/health/live")
        ready = await http.get("/health/ready")
        assert live.status_code == 200
        assert ready.status_code == 503
        assert ready.json()["reasons"] == ["the app has not marked itself ready (Lifecycle.mark_ready)"]
        gate.set()
        await wait_until(lambda: app.state.lifecycle.ready)
        assert (await http.get("/health/ready")).status_code == 200
        assert len(calls) == 1 and calls[0].max_new_tokens == [4]  # one real generate ran
        answer = await http.post("/v1/generate", json={"prompt": "Hello", "max_new_tokens": 2})
        assert answer.status_code == 200
    logged = [record.getMessage() for record in caplog.records if record.name == "demo_service"]
    assert any(message.startswith("Ready: the model is loaded and one generation has run") for message in logged)


async def test_a_non_streaming_client_that_leaves_stops_its_generation(model: LoadedModel) -> None:
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 1024, "temperature": 0}).encode()
    async with serving(model) as (app, port):
        ledger, batcher = ledger_of(app), batcher_of(app)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
        await wait_until(lambda: batcher.tokens_generated >= 3, timeout=60)  # generating, no byte sent yet
        assert ledger.statistics().reserved_bytes > 0
        writer.close()
        assert await bytes_back_after_the_batch(app)  # the bytes came back once the batch had left the device
        await wait_until(lambda: batcher.idle, timeout=60)
        assert batcher.tokens_generated < 200  # stopped early, not at 1,024
        assert ledger.statistics().in_flight == 0
