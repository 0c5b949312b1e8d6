"""Which of vLLM's routes are admitted, and how: every route that generates tokens into the KV cache.

The rule (docs/vllm.md): ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/responses`` are
admitted for ``(prompt + max_tokens)`` tokens in whole blocks, ``n`` sequences each; every other
route (embeddings, pooling, scoring, tokenize, models, health, metrics) passes through, as vLLM
serves them in one forward pass that frees its blocks at once. A request whose ``max_tokens`` is
unset is admitted for ``max_model_len`` tokens, which is what vLLM lets it generate.

The routes are tagged where vLLM's router names them, at startup, on an alias of each endpoint
(the endpoint's own function, shared by every app in the process, is left alone): admission then
happens at the endpoint's body read, after vLLM's own middleware (API key, CORS) has let it through.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

from .._admission.spec import RouteSpec
from .._asgi.routes import SPEC_ATTRIBUTE, route_spec_of
from .._estimate.paged import PagedKVEstimator
from .prompts import ChatTemplate, PromptGetter, chat_prompt, completion_prompt, responses_prompt, special_prefix
from .server import VLLMServer

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
RESPONSES = "/v1/responses"
#: OpenAI's names for the generation limit, read in this order (``max_output_tokens``: responses).
MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
#: The most sequences one request may ask for (``n``); vLLM sets no limit of its own.
MAX_N = 128


def route_specs(server: VLLMServer, estimator: PagedKVEstimator, *, patient: bool = False) -> dict[str, RouteSpec]:
    """The spec of each generating route, keyed by path; ``patient``: ``GPU_ASGI_PATIENT``."""
    chat = ChatTemplate(server.tokenizer, server.chat_template, server.chat_template_kwargs)
    prompts: dict[str, PromptGetter] = {
        COMPLETIONS: completion_prompt(special_prefix(server.tokenizer)),
        CHAT_COMPLETIONS: chat_prompt(chat),
        RESPONSES: responses_prompt(chat),
    }
    defaults = {COMPLETIONS: completion_default_max_tokens(server.max_model_len)}
    return {
        path: RouteSpec(
            prompt=prompt,
            max_tokens_fields=MAX_TOKENS_FIELDS,
            default_max_new_tokens=defaults.get(path, server.max_model_len),
            max_new_tokens_cap=server.max_model_len,
            max_batch=MAX_N,
            estimator=estimator,
            chat_template_tokens=0,  # the template is rendered and counted, not guessed
            openai_errors=True,
            patient=patient,
        )
        for path, prompt in prompts.items()
    }


def completion_default_max_tokens(max_model_len: int) -> int:
    """The tokens vLLM generates for a ``/v1/completions`` request without ``max_tokens``: the
    default of its ``CompletionRequest`` model; ``max_model_len`` (the most it could be, so never
    too little) where that model cannot be read or its default is not a limit."""
    try:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        default = CompletionRequest.model_fields["max_tokens"].default
    except (ImportError, AttributeError, KeyError):
        return max_model_len
    return default if type(default) is int and 1 <= default <= max_model_len else max_model_len


def tag_routes(routes: Iterable[Any], specs: Mapping[str, RouteSpec]) -> list[str]:
    """Tag each POST route at a path of ``specs``; returns ``"POST /path"`` for each one tagged.

    The route's ``endpoint`` (what the router writes into ``scope["endpoint"]``) becomes an alias
    that carries the tag; the route still calls the function it was built with."""
    tagged = []
    for route in routes:
        spec = specs.get(getattr(route, "path", ""))
        methods = getattr(route, "methods", None) or set()
        endpoint = getattr(route, "endpoint", None)
        if spec is None or endpoint is None or methods != {"POST"}:
            continue
        if route_spec_of(endpoint, "POST") is not None:
            continue  # already tagged (a second start of the same app): keep it
        alias = functools.partial(endpoint)
        functools.update_wrapper(alias, endpoint)  # its name and docs, for FastAPI's OpenAPI schema
        setattr(alias, SPEC_ATTRIBUTE, spec)
        route.endpoint = alias
        tagged.append(f"POST {route.path}")
    return tagged
