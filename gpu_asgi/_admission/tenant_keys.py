"""Tenant keys: how admission finds whom a request is for.

A :class:`TenantKey` names one source: a header, a field of the JSON body (OpenAI's ``user``),
a hash of the API key, or a callable. The gate tries its keys in order and the first that
finds a value wins; none found means :data:`DEFAULT_TENANT`. The ledgers only ever see the string
(metrics and spans see a bounded label: ``_observe.labels``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidTenant
from .._ledger.tenants import DEFAULT_TENANT
from .._types import Scope

#: Longest tenant key accepted; longer ones are refused (a tenant names an account, not a payload).
MAX_TENANT_LENGTH = 128
#: Hex digits of sha256 kept in an API-key tenant: 64 bits, so two keys among a million share a
#: tenant with a probability of about 3e-8.
API_KEY_HASH_HEX = 16
API_KEY_PREFIX = "key-"

TenantCallable = Callable[[Scope, Mapping[str, Any]], "str | None"]


def api_key_tenant(key: str, *, secret: bytes | None = None) -> str:
    """The tenant an API key maps to: ``key-`` and the first 16 hex digits of the sha256 of its
    UTF-8 bytes, the bytes a client sends (HMAC-SHA256 under ``secret`` when given). Use it to name
    API-key tenants in ``tenants=``: a request with that key gets this tenant."""
    raw = key.encode("utf-8")
    digest = hmac.new(secret, raw, hashlib.sha256) if secret is not None else hashlib.sha256(raw)
    return API_KEY_PREFIX + digest.hexdigest()[:API_KEY_HASH_HEX]


@dataclass(frozen=True, slots=True)
class TenantKey:
    """One place a request's tenant is read from; build it with a class method:

    - ``TenantKey.header("x-tenant-id")``: the header's value, as UTF-8;
    - ``TenantKey.body_field("user")``: a string field of the JSON body (OpenAI's ``user``);
    - ``TenantKey.api_key(secret=None)``: a hash of ``Authorization: Bearer ...`` or ``x-api-key``
      (see :func:`api_key_tenant`), never the key itself;
    - ``TenantKey.from_callable(fn)``: ``fn(scope, body) -> str | None``.
    """

    kind: str
    name: str = ""
    secret: bytes | None = None
    function: TenantCallable | None = None

    @classmethod
    def header(cls, name: str = "x-tenant-id") -> TenantKey:
        return cls("header", name.lower())

    @classmethod
    def body_field(cls, name: str = "user") -> TenantKey:
        return cls("body_field", name)

    @classmethod
    def api_key(cls, *, secret: bytes | None = None) -> TenantKey:
        return cls("api_key", "authorization", secret)

    @classmethod
    def from_callable(cls, function: TenantCallable) -> TenantKey:
        return cls("callable", getattr(function, "__qualname__", "tenant callable"), function=function)

    def __post_init__(self) -> None:
        if self.kind not in ("header", "body_field", "api_key", "callable"):
            raise ValueError(f"unknown tenant key kind {self.kind!r}: use TenantKey.header/body_field/api_key/from_callable")
        if self.kind in ("header", "body_field") and not self.name:
            raise ValueError(f"TenantKey.{self.kind} needs a name")
        if self.kind == "callable" and not callable(self.function):
            raise TypeError("TenantKey.from_callable needs a callable (scope, body) -> str | None")

    def __repr__(self) -> str:
        if self.kind == "api_key":
            return f"TenantKey.api_key(secret={'...' if self.secret is not None else None})"
        if self.kind == "callable":
            return f"TenantKey.from_callable({self.name})"
        return f"TenantKey.{self.kind}({self.name!r})"

    def find(self, scope: Scope, body: Mapping[str, Any]) -> str | None:
        """This source's tenant for the request, None when it names none; invalid -> :class:`InvalidTenant`."""
        if self.kind == "header":
            value = _header(scope, self.name.encode("latin-1"))
            return None if value is None else _checked(_utf8(value, "tenant", self.name), header=self.name)
        if self.kind == "body_field":
            raw = body.get(self.name)
            if raw is None:
                return None
            if not isinstance(raw, str):
                raise InvalidTenant(f"{self.name!r} names the tenant and must be a string.", field=self.name)
            return _checked(raw, field=self.name)
        if self.kind == "api_key":
            key, header = _api_key(scope)
            if key is None:
                return None
            _checked(key, header=header, length=False)
            return api_key_tenant(key, secret=self.secret)
        assert self.function is not None
        try:
            found = self.function(scope, body)
        except Exception as exc:  # the host's code: whatever it raises, this request did not fit it
            raise InvalidTenant(f"The tenant could not be read by {self.name}: {type(exc).__name__}: {exc}.") from None
        if found is None:
            return None
        if not isinstance(found, str):
            raise TypeError(f"{self.name} returned {type(found).__name__}; a tenant key is a str or None")
        return _checked(found, source=self.name)


def find_tenant(keys: Sequence[TenantKey], scope: Scope, body: Mapping[str, Any]) -> str:
    """The first tenant one of ``keys`` finds, else :data:`DEFAULT_TENANT`."""
    for key in keys:
        tenant = key.find(scope, body)
        if tenant:
            return tenant
    return DEFAULT_TENANT


def tenant_keys(value: TenantKey | Sequence[TenantKey] | None) -> tuple[TenantKey, ...]:
    """A ``tenant_key=`` option as a tuple (empty: tenants are off)."""
    if value is None:
        return ()
    keys = (value,) if isinstance(value, TenantKey) else tuple(value)
    for key in keys:
        if not isinstance(key, TenantKey):
            raise TypeError(f"tenant_key takes TenantKey objects, not {type(key).__name__}")
    return keys


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value  # type: ignore[no-any-return]
    return None


def _api_key(scope: Scope) -> tuple[str | None, str]:
    """The API key from ``Authorization: Bearer <key>``, else ``x-api-key``, and the header it came
    from. Its bytes are taken as sent, but for the ASCII whitespace around them, and decoded as
    UTF-8, so that ``api_key_tenant`` (which encodes a key as UTF-8) hashes exactly those bytes."""
    bearer = _header(scope, b"authorization")
    if bearer is not None:
        scheme, _, token = bearer.partition(b" ")
        token = token.strip()
        if scheme.lower() == b"bearer" and token:
            return _utf8(token, "API key", "authorization"), "authorization"
    key = _header(scope, b"x-api-key")
    if key is not None and key.strip():
        return _utf8(key.strip(), "API key", "x-api-key"), "x-api-key"
    return None, ""


def _utf8(value: bytes, what: str, header: str) -> str:
    """A header's value as text. HTTP leaves the meaning of non-ASCII bytes to the application;
    clients send non-ASCII names as UTF-8 (and a JSON body's ``user`` is UTF-8 too), so that is
    how they are read. Bytes that are not UTF-8 -> :class:`InvalidTenant` naming the header."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidTenant(f"The {what} in header {header!r} is not valid UTF-8.", header=header) from None


def _checked(value: str, *, header: str | None = None, field: str | None = None, source: str | None = None,
             length: bool = True) -> str | None:
    """``value`` when usable as a tenant key; empty is no tenant (None); too long or with control
    characters -> :class:`InvalidTenant` naming where it came from."""
    if not value:
        return None
    where = f"header {header!r}" if header else f"field {field!r}" if field else (source or "the tenant callable")
    extensions: dict[str, Any] = {"header": header} if header else {"field": field} if field else {}
    if length and len(value) > MAX_TENANT_LENGTH:
        raise InvalidTenant(f"The tenant in {where} is {len(value)} characters long; at most {MAX_TENANT_LENGTH} are allowed.",
                            **extensions)
    if not value.isprintable():
        raise InvalidTenant(f"The tenant in {where} contains control or non-printable characters.", **extensions)
    return value
