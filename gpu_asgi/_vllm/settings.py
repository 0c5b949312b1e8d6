"""The few settings of vLLM's admission that vLLM cannot tell: read from ``GPU_ASGI_*`` variables.

vLLM builds a ``--middleware`` class with no arguments, so its settings come from the environment,
read here and nowhere else, once at startup. A variable that is unknown (a typo), malformed or out
of range stops the server with a message naming it, rather than being ignored or failing later.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from .._admission.tenant_keys import TenantKey
from .._ledger.contract import DEFAULT_MAX_QUEUE, DEFAULT_MAX_WAIT, DEFAULT_REDIS_TIMEOUT
from .._ledger.tenants import TenantPolicy
from .._ledger.url import REDIS_SCHEMES

PREFIX = "GPU_ASGI_"
DEFAULT_NAMESPACE = "gpu_asgi:vllm"
#: ``GPU_ASGI_GROWTH``'s default: the quantile of the running answers' growth held while following.
DEFAULT_GROWTH = 0.99
#: ``GPU_ASGI_RESERVE=learned``'s quantile: the median, where an app's ``OutputLengths`` takes 0.9.
#: Behind vLLM a miss costs a preemption, not an OOM, and following grows each miss as it runs,
#: holding the 0.99 quantile of the running answers' growth (``GPU_ASGI_GROWTH``): that, not this,
#: bounds the preemptions (docs/benchmarks.md, "What is reserved").
LEARNED_QUANTILE = 0.5
#: The largest over-subscription accepted: beyond it vLLM preempts on nearly every step.
MAX_OVERSUBSCRIBE = 4.0

T = TypeVar("T")


class SettingsError(ValueError):
    """A ``GPU_ASGI_*`` variable is unknown or invalid; the message names it and what it takes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class VLLMSettings:
    """What gpu_asgi adds to vLLM, beyond what it learns from the server (docs/vllm.md)."""

    #: ``GPU_ASGI_MAX_WAIT``: seconds a request waits for KV-cache room at most (and the cap on
    #: its ``x-request-timeout``), then 503/429 with ``Retry-After``.
    max_wait: float = DEFAULT_MAX_WAIT
    #: ``GPU_ASGI_PATIENT``: ``1`` keeps every request in the queue for ``max_wait`` whatever its
    #: predicted wait (batch traffic); ``0``, the default, refuses at arrival a request predicted
    #: to wait longer than its deadline (``x-request-timeout``, else ``max_wait``).
    patient: bool = False
    #: ``GPU_ASGI_MAX_QUEUE``: requests waiting at once at most (per process); more are refused.
    max_queue: int = DEFAULT_MAX_QUEUE
    #: ``GPU_ASGI_REJECT_STATUS``: 503 or 429, the status of an overload refusal.
    reject_status: int = 503
    #: ``GPU_ASGI_TENANT_KEY``: where a request's tenant is read, tried in order (empty: no tenants).
    tenant_key: tuple[TenantKey, ...] = ()
    #: ``GPU_ASGI_TENANT_WEIGHTS``: fair-share weights of named tenants (others weigh 1).
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    #: ``GPU_ASGI_LEDGER_URL``: ``redis://...`` to share one budget between API server processes
    #: or replicas on one GPU; unset: this process alone.
    ledger_url: str | None = None
    #: ``GPU_ASGI_LEDGER_NAMESPACE``: the Redis keys' prefix: one per shared KV cache.
    namespace: str = DEFAULT_NAMESPACE
    #: ``GPU_ASGI_OVERSUBSCRIBE``: admit up to this many times the KV cache (1.0: never preempt).
    oversubscribe: float = 1.0
    #: ``GPU_ASGI_RESERVE``: ``strict`` reserves ``prompt + max_tokens`` (never a preemption);
    #: ``learned`` (the default) or a quantile in (0, 1] reserves ``prompt +`` that quantile of the
    #: lengths answers of the route really had (``learned`` is 0.5). None: strict.
    quantile: float | None = LEARNED_QUANTILE
    #: ``GPU_ASGI_FOLLOW``: with learned lengths, hold each running answer at the blocks it holds
    #: and the growth the running set is forecast to take, read from vLLM's progress (``1``, the
    #: default), or hold each at its predicted length from its start (``0``).
    follow: bool = True
    #: ``GPU_ASGI_GROWTH``: while following, hold a quantile in (0, 1) of the growth the running
    #: answers may take (0.99, the default), each answer going on with the chance its route's
    #: answers that got as far went on (several rarely all run long; a miss preempts), or ``all``
    #: of it (None).
    growth: float | None = DEFAULT_GROWTH
    #: ``GPU_ASGI_LENGTHS_FILE``: a file where learned lengths are saved (every 30 s and at
    #: shutdown) and restored from at startup, if written for the same model within a day: a
    #: restarted server starts warm. Unset: every start is cold (strict until answers are learnt).
    lengths_file: str | None = None
    #: ``GPU_ASGI_REDIS_TIMEOUT``: seconds the shared ledger waits for one Redis answer before
    #: admission fails closed (``ledger-unavailable``); raise it on a host whose CPUs are saturated.
    redis_timeout: float = DEFAULT_REDIS_TIMEOUT

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> VLLMSettings:
        """The settings in ``environ`` (``os.environ``); unset variables keep their defaults."""
        ours = {name: value for name, value in environ.items() if name.startswith(PREFIX)}
        unknown = sorted(set(ours) - set(_PARSERS))
        if unknown:
            raise SettingsError(
                f"unknown setting {', '.join(unknown)}: gpu_asgi.vllm reads {', '.join(sorted(_PARSERS))} (docs/vllm.md)"
            )
        values = {}
        for name, value in ours.items():
            attribute, parse = _PARSERS[name]
            try:
                values[attribute] = parse(value.strip())
            except ValueError as error:
                raise SettingsError(f"{name}={value!r}: {error}") from None
        return cls(**values)  # type: ignore[arg-type]

    def tenant_policies(self) -> dict[str, TenantPolicy]:
        return {name: TenantPolicy(weight=weight) for name, weight in self.tenant_weights.items()}


def _number(kind: Callable[[str], T], low: float, high: float, what: str) -> Callable[[str], T]:
    def parse(text: str) -> T:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"expected {what}") from None
        if not low <= value <= high:  # type: ignore[operator]
            raise ValueError(f"expected {what}")
        return value

    return parse


def _reject_status(text: str) -> int:
    if text not in ("429", "503"):
        raise ValueError("expected 429 or 503")
    return int(text)


def _tenant_keys(text: str) -> tuple[TenantKey, ...]:
    """``api-key``, ``header:NAME`` or ``field:NAME`` (``user`` is ``field:user``), comma-separated."""
    keys = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, name = item.partition(":")
        if item == "api-key":
            keys.append(TenantKey.api_key())
        elif item == "user":
            keys.append(TenantKey.body_field("user"))
        elif kind == "header" and name:
            keys.append(TenantKey.header(name))
        elif kind == "field" and name:
            keys.append(TenantKey.body_field(name))
        else:
            raise ValueError(f"{item!r} is not api-key, user, header:NAME or field:NAME")
    return tuple(keys)


def _tenant_weights(text: str) -> dict[str, float]:
    """``name=weight`` pairs, comma-separated (an API-key tenant's name: ``gpu_asgi.api_key_tenant``)."""
    weights = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, raw = item.rpartition("=")
        try:
            weight = float(raw)
        except ValueError:
            weight = math.nan
        if not sep or not name.strip() or not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"{item!r} is not name=weight with a positive weight")
        weights[name.strip()] = weight
    return weights


def _ledger_url(text: str) -> str | None:
    scheme = text.partition("://")[0].lower()
    if not text or scheme == "memory":
        return None
    if scheme not in REDIS_SCHEMES:
        raise ValueError("expected redis://, rediss://, unix://, redis+sentinel:// or memory://")
    return text


def _quantile(text: str, *, one: bool) -> float:
    """A number in (0, 1] (``one``) or (0, 1); NaN where it is none."""
    try:
        quantile = float(text)
    except ValueError:
        return math.nan
    return quantile if 0 < quantile < 1 or (one and quantile == 1) else math.nan


def _reserve(text: str) -> float | None:
    """``strict``, ``learned`` (the default quantile) or a quantile in (0, 1]."""
    if text.lower() == "strict":
        return None
    if text.lower() == "learned":
        return LEARNED_QUANTILE
    quantile = _quantile(text, one=True)
    if math.isnan(quantile):
        raise ValueError("expected strict, learned or a quantile in (0, 1]")
    return quantile


def _growth(text: str) -> float | None:
    """``all`` or a quantile in (0, 1)."""
    if text.lower() == "all":
        return None
    quantile = _quantile(text, one=False)
    if math.isnan(quantile):
        raise ValueError("expected all or a quantile in (0, 1)")
    return quantile


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        raise ValueError("expected 1 or 0 (true/false, yes/no, on/off)")
    return value in ("1", "true", "yes", "on")


def _path(text: str) -> str:
    if not text or "\0" in text:
        raise ValueError("expected a file path")
    return text


def _namespace(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise ValueError("expected a non-empty name without spaces")
    return text


_PARSERS: dict[str, tuple[str, Callable[[str], object]]] = {
    "GPU_ASGI_MAX_WAIT": ("max_wait", _number(float, 0.001, 86_400, "seconds from 0.001 to 86400")),
    "GPU_ASGI_PATIENT": ("patient", _flag),
    "GPU_ASGI_MAX_QUEUE": ("max_queue", _number(int, 0, 1_000_000, "an integer from 0 to 1000000")),
    "GPU_ASGI_REJECT_STATUS": ("reject_status", _reject_status),
    "GPU_ASGI_TENANT_KEY": ("tenant_key", _tenant_keys),
    "GPU_ASGI_TENANT_WEIGHTS": ("tenant_weights", _tenant_weights),
    "GPU_ASGI_LEDGER_URL": ("ledger_url", _ledger_url),
    "GPU_ASGI_LEDGER_NAMESPACE": ("namespace", _namespace),
    "GPU_ASGI_REDIS_TIMEOUT": ("redis_timeout", _number(float, 0.01, 60, "seconds from 0.01 to 60")),
    "GPU_ASGI_RESERVE": ("quantile", _reserve),
    "GPU_ASGI_FOLLOW": ("follow", _flag),
    "GPU_ASGI_GROWTH": ("growth", _growth),
    "GPU_ASGI_LENGTHS_FILE": ("lengths_file", _path),
    "GPU_ASGI_OVERSUBSCRIBE": ("oversubscribe", _number(float, 0.1, MAX_OVERSUBSCRIBE, f"a factor from 0.1 to {MAX_OVERSUBSCRIBE:g}")),
}
