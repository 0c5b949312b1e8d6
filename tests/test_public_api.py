"""The public API holds still: a small ``__all__``, names that left it still importable (errors with a
DeprecationWarning), ``RedisLedger`` from the package without importing redis, public reprs, and
an estimator written to the first documented signature still admitting requests."""

from __future__ import annotations

import subprocess
import sys
import warnings
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import gpu_asgi
from gpu_asgi import GPUAdmissionMiddleware, Ledger, gpu_admission, gpu_bound

from ._asgi import Words, client

DEPRECATED = (
    "BodyError", "BodyTimeout", "BodyTooLarge", "ClientClosedRequest", "DeadlineUnmeetable", "DeviceMemoryLow",
    "DeviceProbeFailed", "InvalidField", "InvalidHeader", "InvalidJSON", "InvalidTenant", "OverTenantQuota",
    "UnsupportedMediaType",
)


def test_all_is_small_and_every_name_in_it_resolves() -> None:
    assert 35 <= len(gpu_asgi.__all__) <= 50
    assert len(set(gpu_asgi.__all__)) == len(gpu_asgi.__all__)
    for name in gpu_asgi.__all__:
        assert getattr(gpu_asgi, name) is not None, name
    namespace: dict[str, Any] = {}
    exec("from gpu_asgi import *", namespace)  # star-import resolves every name, the lazy one included
    assert set(gpu_asgi.__all__) <= set(namespace)


@pytest.mark.parametrize("name", DEPRECATED)
def test_an_error_outside_all_imports_with_a_deprecation_warning(name: str) -> None:
    from gpu_asgi import _errors

    assert name not in gpu_asgi.__all__
    with pytest.warns(DeprecationWarning, match=f"gpu_asgi.{name} is deprecated"):
        value = getattr(gpu_asgi, name)
    assert value is getattr(_errors, name)  # the very class the middleware raises
    assert issubclass(value, gpu_asgi.GPUAdmissionError)


def test_errors_kept_in_all_import_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from gpu_asgi import AdmissionRejected, LedgerUnavailable, NeverFits, QueueFull, QueueTimeout  # noqa: F401


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        gpu_asgi.Nope  # noqa: B018


def test_redis_ledger_is_exported_lazily() -> None:
    code = (
        "import sys, gpu_asgi\n"
        "assert 'redis' not in sys.modules, 'import gpu_asgi imported redis'\n"
        "from gpu_asgi import RedisLedger\n"
        "assert 'redis' in sys.modules\n"
        "from gpu_asgi.redis_ledger import RedisLedger as Old\n"
        "assert Old is RedisLedger and RedisLedger.__module__ == 'gpu_asgi'\n"
        "assert 'RedisLedger' in dir(gpu_asgi)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_classes_show_their_public_name() -> None:
    assert repr(GPUAdmissionMiddleware) == "<class 'gpu_asgi.GPUAdmissionMiddleware'>"
    for name in gpu_asgi.__all__:
        value = getattr(gpu_asgi, name)
        if isinstance(value, type) or callable(value):
            assert value.__module__ == "gpu_asgi", name
    assert gpu_asgi.Phase.__module__ == "gpu_asgi"  # public, though not in __all__


async def test_an_estimator_of_the_first_documented_shape_admits_requests() -> None:
    """``estimate(prompt_tokens, max_new_tokens, batch)`` with no ``sampling=``: it is wrapped once
    and called without it (it was refused with TypeError at startup)."""
    calls: list[tuple[int, int, int]] = []

    class FirstShape:
        def estimate(self, prompt_tokens: int, max_new_tokens: int, batch: int = 1) -> int:
            calls.append((prompt_tokens, max_new_tokens, batch))
            return 10 * (prompt_tokens + max_new_tokens)

    ledger = Ledger({"cpu": 1_000})
    held: list[int] = []

    @gpu_bound()
    async def generate(request: Request) -> JSONResponse:
        body = await request.json()
        held.append(ledger.statistics().reserved_bytes)
        return JSONResponse({"bytes": (await gpu_admission(request)).estimated_bytes, "echo": body["prompt"]})

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
    app.add_middleware(
        GPUAdmissionMiddleware, ledger=ledger, estimator=FirstShape(), token_counter=Words()  # type: ignore[arg-type]
    )
    async with client(app) as http:
        ok = await http.post("/generate", json={"prompt": "a b c", "max_new_tokens": 4, "temperature": 0.5})
        too_big = await http.post("/generate", json={"prompt": "a " * 200, "max_new_tokens": 4})
    assert ok.status_code == 200 and ok.json() == {"bytes": 70, "echo": "a b c"}
    assert held == [70] and calls[0] == (3, 4, 1)
    assert too_big.status_code == 413 and too_big.headers["content-type"] == "application/problem+json"
    assert ledger.statistics().reserved_bytes == 0
