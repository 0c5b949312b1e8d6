"""``RouteSpec``: how one GPU-bound route is admitted (what admission reads from a request's body,
how it is estimated, queued and named), with its defaults. A value: tagging builds it, the gate reads it."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any

from .._estimate.contract import Estimator, as_estimator
from .._ledger.contract import check_priority
from .tenant_keys import TenantKey, tenant_keys

DEFAULT_PROMPT_FIELDS = ("prompt", "messages")
#: OpenAI reads ``max_completion_tokens`` before the deprecated ``max_tokens``.
DEFAULT_MAX_TOKENS_FIELDS = ("max_new_tokens", "max_completion_tokens", "max_tokens")
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_MAX_NEW_TOKENS_CAP = 4096
#: Room for what a chat template adds once per conversation: a default system prompt when the
#: client sent none (Qwen2.5's is 21 tokens with its markers) and the generation prompt (3).
DEFAULT_CHAT_TEMPLATE_TOKENS = 32
#: Methods whose requests carry no body by HTTP semantics. Admission reads the body, so a tagged
#: route may not accept these, and requests with them always pass through (docs/admission.md).
BODYLESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})

PromptGetter = Callable[[Any], "str | Sequence[str]"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteSpec:
    """How one GPU-bound route is admitted.

    ``prompt`` is either field names tried in order (a string or list of strings, or OpenAI
    ``messages``) or a callable that takes the parsed body and returns the prompt text(s).
    """

    prompt: Sequence[str] | PromptGetter = DEFAULT_PROMPT_FIELDS
    max_tokens_fields: Sequence[str] = DEFAULT_MAX_TOKENS_FIELDS
    default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_new_tokens_cap: int = DEFAULT_MAX_NEW_TOKENS_CAP
    #: Body field holding the number of sequences generated (OpenAI ``n``); None to ignore.
    batch_field: str | None = "n"
    max_batch: int = 16
    estimator: Estimator | None = None
    #: Higher is admitted first; FIFO within a priority.
    priority: int = 0
    #: Devices this route may run on; None means any device of the ledger.
    devices: tuple[str, ...] | None = None
    #: Methods matched for paths registered explicitly (routers match methods themselves).
    methods: frozenset[str] = field(default=frozenset({"POST"}))
    #: Tokens added to OpenAI ``messages`` once per conversation, for the chat template.
    chat_template_tokens: int = DEFAULT_CHAT_TEMPLATE_TOKENS
    #: Refusals also carry OpenAI's ``error`` object; None follows the middleware's ``openai_errors``.
    openai_errors: bool | None = None
    #: The deadline of this route's requests: seconds one waits in the queue at most, and the cap
    #: on its ``x-request-timeout`` header; None: the ledger's ``max_wait``. A request whose
    #: predicted wait is longer is refused at once (``deadline-unmeetable``) instead of timing out
    #: in the queue.
    deadline: float | None = None
    #: The patient queue, for batch traffic: a request without ``x-request-timeout`` waits up to
    #: its deadline (or ``max_wait``) whatever the predicted wait, and is refused only when that
    #: runs out (``queue-timeout``), as before refusal at arrival was the default.
    patient: bool = False
    #: Where this route's tenant is read (tried in order); None follows the middleware's ``tenant_key``.
    tenant_key: TenantKey | Sequence[TenantKey] | None = None
    #: Cancel the endpoint when its client disconnects before the response starts; False for a
    #: route that must finish. None follows the middleware's ``cancel_on_disconnect``.
    cancel_on_disconnect: bool | None = None
    #: The earlier name of ``deadline``, accepted for one release with a DeprecationWarning.
    max_client_wait: InitVar[float | None] = None

    def __post_init__(self, max_client_wait: float | None) -> None:
        if max_client_wait is not None:
            warnings.warn(
                "RouteSpec(max_client_wait=) and gpu_bound(max_client_wait=) are deprecated: pass deadline= "
                "(the same seconds: the most a request waits in the queue, and the cap on its x-request-timeout)",
                DeprecationWarning, stacklevel=3,
            )
            if self.deadline is not None:
                raise TypeError("pass deadline= alone: max_client_wait= is its deprecated name")
            object.__setattr__(self, "deadline", max_client_wait)
        if self.estimator is not None:
            object.__setattr__(self, "estimator", as_estimator(self.estimator))
        if isinstance(self.prompt, str):
            object.__setattr__(self, "prompt", (self.prompt,))
        if isinstance(self.max_tokens_fields, str):
            object.__setattr__(self, "max_tokens_fields", (self.max_tokens_fields,))
        if self.devices is not None:  # a name, or any sequence of names, becomes a tuple
            devices = (self.devices,) if isinstance(self.devices, str) else tuple(self.devices)
            object.__setattr__(self, "devices", devices)
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_cap:
            raise ValueError("need 1 <= default_max_new_tokens <= max_new_tokens_cap")
        if self.max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if self.chat_template_tokens < 0:
            raise ValueError("chat_template_tokens must be >= 0")
        object.__setattr__(self, "methods", frozenset(method.upper() for method in self.methods))
        if not self.methods or self.methods & BODYLESS_METHODS:
            raise ValueError(f"methods must be methods with a request body (admission reads it), not {sorted(self.methods)}")
        if self.deadline is not None and not 0 < self.deadline < math.inf:
            raise ValueError("deadline must be a positive, finite number of seconds (or None)")
        if self.patient and self.deadline is not None:
            raise ValueError("a patient route waits the ledger's max_wait: pass deadline= or patient=True, not both")
        check_priority(self.priority)  # refused when the route is declared, not on its first request
        if self.tenant_key is not None:
            object.__setattr__(self, "tenant_key", tenant_keys(self.tenant_key))


# Read as the deprecated name; the InitVar's default stays what dataclass captured for __init__.
RouteSpec.max_client_wait = property(lambda spec: spec.deadline, doc="The deprecated name of ``deadline``.")  # type: ignore[attr-defined]
