"""Two demo processes' worth of apps on one budget, through the Redis ledger (DEMO_LEDGER_URL)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")
pytest.importorskip("redis")

from demo_service import BucketedEstimator, LoadedModel
from gpu_asgi import AnalyticEstimator

from . import _redis
from ._asgi import client
from ._demo import loaded_model, model_dir, running
from ._redis import EMPTY, RedisServer, eventually, requires_redis_server

pytestmark = requires_redis_server
redis_server, namespace = _redis.redis_server, _redis.namespace  # fixtures


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return loaded_model(model_dir(tmp_path_factory))



@pytest.mark.parametrize("shared", [True, False])
async def test_two_apps_admit_against_one_budget_only_when_shared(
    model: LoadedModel, redis_server: RedisServer, namespace: str, shared: bool
) -> None:
    one = BucketedEstimator(AnalyticEstimator.from_config(model.model.config, dtype=model.dtype)).estimate(8, 64)
    options = {"budget_bytes": one, "max_queue": 0, "batch_window_ms": 0}
    if shared:
        options |= {"ledger_url": redis_server.url, "ledger_namespace": namespace}
    async with running(model, **options) as a, running(model, **options) as b, client(a) as ha, client(b) as hb:
        bodies = [{"prompt": f"Request number {i} here", "max_new_tokens": 64} for i in range(4)]
        responses = await asyncio.gather(*(http.post("/v1/generate", json=body) for http, body in zip([ha, hb] * 2, bodies)))
    statuses = sorted(r.status_code for r in responses)
    # One budget for both: one request at a time. Two in-process ledgers: one each.
    assert statuses == ([200, 503, 503, 503] if shared else [200, 200, 503, 503])
    if shared:
        await eventually(lambda: redis_server.ledger_state(namespace) == EMPTY)
