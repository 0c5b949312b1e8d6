"""Tenant policies, and the tenant a reservation is made for, in both ledgers."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gpu_asgi import DEFAULT_TENANT, Ledger, TenantPolicy
from gpu_asgi._ledger.redis.ledger import RedisLedger


@pytest.mark.parametrize("weight", [0, -1.0, math.inf, math.nan])
def test_a_weight_must_be_positive_and_finite(weight: float) -> None:
    with pytest.raises(ValueError, match="weight"):
        TenantPolicy(weight=weight)


@pytest.mark.parametrize("quota", [0, -5, True, 1.5])
def test_a_quota_must_be_a_positive_integer(quota: object) -> None:
    with pytest.raises(ValueError, match="quota_bytes"):
        TenantPolicy(quota_bytes=quota)  # type: ignore[arg-type]


def test_unnamed_tenants_get_the_default_policy() -> None:
    gold = TenantPolicy(weight=3.0, quota_bytes=500)
    ledger = Ledger(1000, tenants={"gold": gold}, default_tenant_policy=TenantPolicy(weight=0.5))
    assert ledger.tenant_policy("gold") == gold
    assert ledger.tenant_policy("anyone") == TenantPolicy(weight=0.5)


async def test_a_reservation_carries_its_tenant() -> None:
    ledger = Ledger(1000)
    assert ledger.try_reserve(10).tenant == DEFAULT_TENANT  # type: ignore[union-attr]
    reservation = await ledger.reserve(10, tenant="acme")
    assert reservation.tenant == "acme"


def refusal(make: Any, options: dict[str, Any]) -> BaseException:
    """What building a ledger with ``options`` raises (nothing connects to Redis to build one)."""
    with pytest.raises((TypeError, ValueError)) as refused:
        make(options)
    return refused.value


@pytest.mark.parametrize(
    ("options", "error", "says"),
    [
        pytest.param({"tenants": {"a": 2.0}}, TypeError, "tenants['a'] must be a TenantPolicy", id="policy-a-float"),
        pytest.param({"tenants": {"a": {"weight": 2}}}, TypeError, "tenants['a'] must be a TenantPolicy", id="policy-a-dict"),
        pytest.param({"tenants": {7: TenantPolicy()}}, TypeError, "tenant names must be str", id="name-not-a-str"),
        pytest.param({"default_tenant_policy": None}, TypeError, "default_tenant_policy must be a TenantPolicy", id="default-none"),
        pytest.param({"tenant_idle_ttl": math.inf}, ValueError, "tenant_idle_ttl must be a positive, finite", id="ttl-inf"),
        pytest.param({"tenant_idle_ttl": -math.inf}, ValueError, "tenant_idle_ttl must be a positive, finite", id="ttl-minus-inf"),
        pytest.param({"tenant_idle_ttl": math.nan}, ValueError, "tenant_idle_ttl must be a positive, finite", id="ttl-nan"),
        pytest.param({"tenant_idle_ttl": 0}, ValueError, "tenant_idle_ttl must be a positive, finite", id="ttl-0"),
        pytest.param({"tenant_idle_ttl": "300"}, TypeError, "tenant_idle_ttl must be a number", id="ttl-a-str"),
        pytest.param({"tenant_idle_ttl": True}, TypeError, "tenant_idle_ttl must be a number", id="ttl-a-bool"),
    ],
)
def test_tenant_options_are_refused_at_construction_alike_in_both_ledgers(
    options: dict[str, Any], error: type[Exception], says: str
) -> None:
    """Each used to be accepted by one ledger and fail later, or differently, in the other: an
    infinite ttl crashed ``RedisLedger`` with OverflowError, a policy that is not a TenantPolicy
    was an AttributeError at the first reserve, or at once in Redis, and a name that is not a
    str named a tenant in Redis (as JSON) that the in-process ledger never matched."""
    in_process = refusal(lambda o: Ledger(100, **o), options)
    shared = refusal(lambda o: RedisLedger("redis://127.0.0.1:1", 100, **o), options)
    for refused in (in_process, shared):
        assert type(refused) is error and says in str(refused)
    assert str(in_process) == str(shared)
