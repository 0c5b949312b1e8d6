"""docs/architecture.md's "One tagged request, end to end" counts the module crossings of one
tagged FastAPI request; this traces such a request and checks that the count it states is the
count the code makes, so the walk cannot drift from the code unnoticed."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from fastapi import Depends, FastAPI
from pydantic import BaseModel

from gpu_asgi import GPUAdmissionMiddleware, Ledger, LinearEstimator, gpu_bound

ARCHITECTURE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
HOST = "(host)"


class GenerateIn(BaseModel):
    prompt: str
    max_new_tokens: int = 8


def api_key() -> str:
    return "key"


def app() -> FastAPI:
    """The walk's request: a body model, an auth dependency, the tag below the route."""
    api = FastAPI()

    @api.post("/generate")
    @gpu_bound()
    async def generate(body: GenerateIn, key: str = Depends(api_key)) -> dict[str, int]:
        return {"chars": len(body.prompt)}

    api.add_middleware(GPUAdmissionMiddleware, ledger=Ledger(1 << 30), estimator=LinearEstimator(bytes_per_token=1))
    return api


def module_of(frame: FrameType | None) -> str:
    name = "" if frame is None else frame.f_globals.get("__name__", "")
    return name if name.startswith("gpu_asgi") else HOST


async def crossings() -> list[tuple[str, str, str]]:
    """(caller's module, callee's module, function) for every call into gpu_asgi code from
    another module, the host's included; a coroutine resumed is no call."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app()), base_url="http://walk") as client:
        assert (await client.post("/generate", json={"prompt": "hi"})).status_code == 200  # warm: caches filled
        found: list[tuple[str, str, str]] = []
        started: list[FrameType] = []

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            if event != "call" or (callee := module_of(frame)) == HOST or any(f is frame for f in started):
                return
            started.append(frame)
            if (caller := module_of(frame.f_back)) != callee:
                found.append((caller, callee, frame.f_code.co_name))

        threading.setprofile(profile)  # type: ignore[arg-type]
        sys.setprofile(profile)  # type: ignore[arg-type]
        try:
            response = await client.post("/generate", json={"prompt": "hi"})
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
        assert response.status_code == 200
        return found


def part_of(module: str) -> str:
    return module if module == HOST else module.split(".")[1]


async def test_the_walk_states_the_crossings_the_code_makes() -> None:
    found = await crossings()
    modules = {m for pair in found for m in pair[:2]} - {HOST}
    between_parts = [c for c in found if part_of(c[0]) != part_of(c[1])]
    from_host = [c for c in found if c[0] == HOST]
    stated = re.search(
        r"\*\*(\d+) crossings over (\d+) modules\*\*, \*\*(\d+) between parts\*\* \((\d+) of them", ARCHITECTURE.read_text()
    )
    assert stated is not None, "architecture.md states no count"
    listing = "\n".join(" -> ".join(c) for c in found)
    assert (len(found), len(modules), len(between_parts), len(from_host)) == tuple(map(int, stated.groups())), listing
