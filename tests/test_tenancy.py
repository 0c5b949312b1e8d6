"""Tenant policies, and the tenant a reservation is made for, in both ledgers."""

from __future__ import annotations

import math

import pytest

from gpu_asgi import DEFAULT_TENANT, Ledger, TenantPolicy


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
