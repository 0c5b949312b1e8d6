"""Test helpers for the demo service: one local model per test session, apps served in-process.

The tiny model is created once per session (in pytest's base temp folder) and loaded once per
process; every test builds its own app around it (``create_app(settings, model=...)``).
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a model hub

import pytest

from demo_service import DemoSettings, LoadedModel, create_app, ensure_local_model, load_model

from ._asgi import wait_until


def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's tiny model (created by the first test module that asks)."""
    return ensure_local_model(tmp_path_factory.getbasetemp() / "demo-model" / "qwen2-tiny", progress=False)


@functools.cache
def loaded_model(path: Path) -> LoadedModel:
    return load_model(path, device="cpu", progress=False)


def settings(**values: Any) -> DemoSettings:
    """Settings for a test: no progress bars, and nothing from the environment but what is given."""
    return DemoSettings(progress=False, **values)


@asynccontextmanager
async def running(model: LoadedModel, **values: Any) -> AsyncIterator[Any]:
    """A demo app with its lifespan running (batcher started), for ``httpx.ASGITransport``."""
    app = create_app(settings(**values), model=model)
    async with app.router.lifespan_context(app):
        await wait_until(lambda: app.state.lifecycle.ready)  # its warm-up generation has run
        yield app


@asynccontextmanager
async def serving(model: LoadedModel, **values: Any) -> AsyncIterator[tuple[Any, int]]:
    """The demo app behind a real uvicorn on 127.0.0.1 (any free port): ``(app, port)``."""
    import uvicorn

    app = create_app(settings(**values), model=model)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.ensure_future(server.serve())
    await wait_until(lambda: server.started or task.done(), timeout=30)
    if task.done():
        task.result()  # raise the start-up error
    port = server.servers[0].sockets[0].getsockname()[1]
    await wait_until(lambda: app.state.lifecycle.ready)  # its warm-up generation has run
    try:
        yield app, port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


def ledger_of(app: Any) -> Any:
    return app.state.service.ledger


def batcher_of(app: Any) -> Any:
    return app.state.service.batcher


async def bytes_back_after_the_batch(app: Any, timeout: float = 60) -> bool:
    """Wait until the demo's ledger holds no bytes; whether the batch had left the device
    whenever the ledger was seen empty (bytes given back while the device still ran are a leak)."""
    ledger, batcher = ledger_of(app), batcher_of(app)
    early: list[bool] = []

    def released() -> bool:
        free = ledger.statistics().reserved_bytes == 0
        if free and not batcher.idle:
            early.append(True)
        return free

    await wait_until(released, timeout=timeout)
    return not early
