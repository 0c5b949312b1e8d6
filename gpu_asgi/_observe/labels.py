"""Bounded tenant labels for metrics and spans.

Metrics and spans never carry a raw tenant key: :func:`tenant_label` maps it to one of the tenants
named in advance, ``default``, or ``other``, so a client cannot grow a label set by inventing keys.
"""

from __future__ import annotations

from collections.abc import Collection, Container

from .._ledger.contract import BudgetLedger
from .._ledger.tenants import DEFAULT_TENANT

#: The label of every tenant that was not named in advance.
OTHER_TENANT_LABEL = "other"


def named_tenants(ledger: BudgetLedger | None, labels: Collection[str] | None) -> Collection[str]:
    """The tenants that metrics and spans name: ``labels``, else the ledger's configured tenants
    (fixed when the ledger was built, as its policies are). None may be named ``other``, the label
    every unnamed tenant is counted under (its series would silently mix with theirs)."""
    labels = frozenset((() if ledger is None else ledger.tenants) if labels is None else labels)
    if OTHER_TENANT_LABEL in labels:
        raise ValueError(
            f"a tenant named {OTHER_TENANT_LABEL!r} would share its metrics label with every unnamed tenant: rename it"
        )
    return labels


def tenant_label(tenant: str, named: Container[str]) -> str:
    """``tenant`` itself when it was named in advance (or is the default), else ``other``."""
    return tenant if tenant == DEFAULT_TENANT or tenant in named else OTHER_TENANT_LABEL
