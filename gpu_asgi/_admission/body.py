"""Request bodies of tagged routes: bounded buffering, JSON parsing and prompt extraction.

Everything here either returns what admission needs or raises a :class:`BodyError` that says
exactly what is wrong; the endpoint later receives the very same bytes (see the responder).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._errors import BodyTimeout, BodyTooLarge, InvalidField, InvalidHeader, InvalidJSON, UnsupportedMediaType
from .._timers import DelayedCalls
from .._types import Receive, Scope
from .spec import RouteSpec

# Where a route's own body limit is found. Starlette's RequestBodyLimitMiddleware
# (``Route(..., max_body_size=n)``, FastAPI's ``@app.post(..., max_body_size=n)``,
# ``Starlette(max_body_size=n)``) publishes the limit it enforces in the scope before the endpoint
# reads its body. A route's limiter sits inside gpu_asgi, so its own 413 would come only after
# admission, once the bytes were reserved or queued for; admission, at that body read, takes the
# smaller of this and ``max_body_bytes`` and refuses before anything is reserved.
try:  # Starlette >= 1.6, which has per-route limits (starlette.routing imports this module anyway)
    from starlette.middleware.body_limit import MAX_BODY_SIZE_SCOPE_KEY as MAX_BODY_SIZE_SCOPE_KEY  # for _admission
except ImportError:  # pragma: no cover - an older Starlette has no such limit, so nothing sets the key
    MAX_BODY_SIZE_SCOPE_KEY = "starlette.max_body_size"

#: Tokens a chat template adds around each message (ChatML: ``<|im_start|>role\n ... <|im_end|>\n``).
MESSAGE_OVERHEAD_TOKENS = 5
#: How long the client is willing to wait for GPU memory, in seconds (docs/admission.md, Deadlines).
REQUEST_TIMEOUT_HEADER = b"x-request-timeout"
_DECIMAL = re.compile(rb"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")


# Per-request values are plain slotted dataclasses, not frozen ones: a frozen one sets each field
# through object.__setattr__, about 1 µs per request over these and the gate's.
@dataclass(slots=True)
class Prompt:
    """One sequence to generate from: text still to count plus tokens already known."""

    text: str
    known_tokens: int = 0


@dataclass(slots=True)
class ParsedRequest:
    prompts: list[Prompt]
    max_new_tokens: int
    #: Sequences generated per prompt (OpenAI ``n``).
    n: int
    #: True when the body asks for sampling, False for greedy decoding, None when it does not say.
    sampling: bool | None = None
    #: The parsed JSON object, for what else reads the body (a tenant key).
    data: dict[str, Any] = field(default_factory=dict)


def check_headers(scope: Scope, max_bytes: int) -> bytes | None:
    """Reject on headers alone, before reading a byte: wrong media type or an announced size over
    the cap. Returns the raw ``x-request-timeout`` value, if sent (see :func:`client_wait`)."""
    timeout = None
    for name, value in scope["headers"]:
        if name == b"content-type":
            media_type = value.split(b";", 1)[0].strip().lower()
            if media_type != b"application/json" and not media_type.endswith(b"+json"):
                raise UnsupportedMediaType(
                    f"Content-Type must be application/json, not {media_type.decode('latin-1')!r}."
                )
        elif name == b"content-length":
            if not value.isdigit():  # RFC 9110: 1*DIGIT; int() would also take "+21", "1_0", " -4"
                raise InvalidJSON(f"Content-Length must be digits only, not {value.decode('latin-1')!r}.")
            announced = int(value)
            if announced > max_bytes:
                raise BodyTooLarge(
                    f"The body announces {announced} bytes; the limit is {max_bytes}.", limit_bytes=max_bytes
                )
        elif name == REQUEST_TIMEOUT_HEADER:
            timeout = value
    return timeout


def client_wait(raw: bytes, cap: float) -> float:
    """Seconds from an ``x-request-timeout`` value (a positive, finite number), at most ``cap``."""
    # Plain decimals only: float() would also take " 5", "1_0", "inf" and "1e999". A plain decimal
    # can still be too long for a float (400 digits): float() makes that inf, refused here too.
    seconds = float(raw) if _DECIMAL.fullmatch(raw) else 0.0
    if not 0 < seconds < math.inf:
        raise InvalidHeader(
            f"x-request-timeout must be a positive, finite number of seconds, not {raw.decode('latin-1')!r}.",
            header="x-request-timeout",
        )
    return min(seconds, cap)


async def read_body(receive: Receive, max_bytes: int, deadlines: DelayedCalls) -> bytes | None:
    """The whole body, or None when the client disconnected while sending it; more than
    ``max_bytes`` -> :class:`BodyTooLarge`, not all of it within ``deadlines.delay`` s ->
    :class:`BodyTimeout` (``deadlines``: the gate's, one timer for all its reads)."""
    chunks: list[bytes] = []
    size = 0
    # asyncio.timeout's rule (cancel the task at the deadline, and only a cancellation of ours is
    # a timeout), with the deadline kept among the gate's others: no context manager and no timer
    # of its own, since this runs once per tagged request.
    task = asyncio.current_task()
    assert task is not None  # the gate checked for a running loop
    cancelling = task.cancelling()
    expiry = deadlines.call(task.cancel)
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                raise BodyTooLarge(f"The body is larger than the limit of {max_bytes} bytes.", limit_bytes=max_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
    except asyncio.CancelledError:
        if expiry.fired and task.uncancel() <= cancelling:
            raise BodyTimeout(f"The body was not received within {deadlines.delay:g} s.") from None
        raise
    finally:
        expiry.cancel()
    return b"".join(chunks)


def parse_request(body: bytes, spec: RouteSpec, route: Callable[[], str] | None = None) -> ParsedRequest:
    """Parse the JSON body and pull out prompt(s), ``max_new_tokens`` and ``n``.

    ``route()`` names the route in errors from the route's own prompt callable.
    """
    data = json_object(body)
    prompts = _extract_prompts(data, spec, route)
    return ParsedRequest(prompts, _max_new_tokens(data, spec), _n(data, spec), _sampling(data), data)


def _sampling(data: dict[str, Any]) -> bool | None:
    """Greedy or sampling, as Hugging Face ``generate`` (``do_sample``) and OpenAI-style APIs
    (``temperature``; 0 means greedy) say it. Anything else, or an ill-typed value (the endpoint's
    own validation answers for it), is None: the estimator's default, which budgets for sampling
    unless the route says otherwise."""
    do_sample = data.get("do_sample")
    if type(do_sample) is bool:
        return do_sample
    temperature = data.get("temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature >= 0:
        return temperature > 0
    return None


def _load_json_stdlib(body: bytes) -> Any:
    """Exactly what Starlette's ``Request.json()`` (and so FastAPI) accepts: ``json.loads`` on the
    bytes, which also takes a UTF-8 BOM, UTF-16/32, lone surrogate escapes and NaN."""
    try:
        return json.loads(body)
    except UnicodeDecodeError as exc:  # UTF-8, or the UTF-16/32 that json.loads detects from the first bytes
        raise InvalidJSON(f"The body is not valid {exc.encoding.upper()} (byte {exc.start}).") from None
    except json.JSONDecodeError as exc:
        raise InvalidJSON(f"The body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}.") from None
    except RecursionError:
        raise InvalidJSON("The JSON body is nested too deeply.") from None
    except ValueError:
        # The one other error json.loads raises on bytes: its scanner's int() on a number with more
        # digits than CPython converts (sys.get_int_max_str_digits(), 4300 unless configured). Its
        # own message tells the server to raise the limit; the client needs to hear what is wrong.
        raise InvalidJSON(
            f"The JSON body has an integer with more than {sys.get_int_max_str_digits()} digits."
        ) from None


def _load_json_orjson(body: bytes) -> Any:
    """orjson first (about 4x faster on a 1 KB body); what it refuses goes to the stdlib parser,
    so the accepted set is the stdlib's and errors read the same either way."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return _load_json_stdlib(body)


try:
    import orjson
except ImportError:  # pragma: no cover - depends on the install
    load_json = _load_json_stdlib
else:
    load_json = _load_json_orjson


def json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or :class:`InvalidJSON`/:class:`InvalidField` saying what is wrong."""
    data = load_json(body)
    if not isinstance(data, dict):
        raise InvalidField(f"The JSON body must be an object, not {_json_type(data)}.")
    return data


def _extract_prompts(data: dict[str, Any], spec: RouteSpec, route: Callable[[], str] | None) -> list[Prompt]:
    if callable(spec.prompt):
        try:
            value = spec.prompt(data)
        except Exception as exc:  # the route's own code: whatever it raises, the body did not fit it
            raise InvalidField(
                f"The prompt could not be read from the body by the prompt callable of {'this route' if route is None else route()}: "
                f"{type(exc).__name__}: {exc}."
            ) from None
        return _prompts_from_value("prompt", value)
    for name in spec.prompt:
        if name in data:
            value = data[name]
            if name == "messages" or (isinstance(value, list) and value and isinstance(value[0], dict)):
                return [_prompt_from_messages(name, value, spec.chat_template_tokens)]
            return _prompts_from_value(name, value)
    expected = " or ".join(repr(name) for name in spec.prompt)
    raise InvalidField(f"The body has no prompt: expected the field {expected}.", field=spec.prompt[0])


def _prompts_from_value(name: str, value: Any) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists (OpenAI)."""
    if isinstance(value, str):
        _check_unicode(name, value)
        return [Prompt(value)]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            for index, item in enumerate(value):
                _check_unicode(f"{name}[{index}]", item)
            return [Prompt(item) for item in value]
        if all(_is_token_ids(item) for item in value):
            return [Prompt("", len(item)) for item in value]
        if _is_token_ids(value):
            return [Prompt("", len(value))]
    raise InvalidField(
        f"{name!r} must be a string, a non-empty list of strings, a non-empty list of token ids "
        f"or a list of those lists, not {_json_type(value)}.",
        field=name,
    )


def _prompt_from_messages(name: str, messages: Any, template_tokens: int) -> Prompt:
    """OpenAI chat ``messages``: content is a string, null, or a list of parts (``text`` parts counted).

    Known tokens: each message's template markers, plus ``template_tokens`` for what the template
    adds once (a default system prompt, the generation prompt).
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidField(f"{name!r} must be a non-empty list of messages.", field=name)
    texts: list[str] = []
    for index, message in enumerate(messages):
        where = f"{name}[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidField(f"{where} must be an object with a string 'role'.", field=where)
        role = message["role"]
        _check_unicode(f"{where}.role", role)
        texts.append(role)
        content = message.get("content")
        if isinstance(content, str):
            _check_unicode(f"{where}.content", content)
            texts.append(content)
        elif isinstance(content, list):
            for number, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise InvalidField(f"{where}.content parts must be objects with a 'type'.", field=where)
                if part["type"] == "text":
                    text = part.get("text")
                    if not isinstance(text, str):
                        raise InvalidField(f"{where}.content text parts need a string 'text'.", field=where)
                    _check_unicode(f"{where}.content[{number}].text", text)
                    texts.append(text)
        elif content is not None:
            raise InvalidField(f"{where}.content must be a string, a list of parts or null.", field=where)
    return Prompt("\n".join(texts), MESSAGE_OVERHEAD_TOKENS * len(messages) + template_tokens)


def _check_unicode(field: str, text: str) -> None:
    """Refuse text to count that is not valid Unicode: a lone surrogate, which the JSON escape
    ``"\\ud800"`` gives and ``json.loads`` accepts, but which no tokenizer reads (UTF-8 has no
    encoding for it; a Hugging Face tokenizer raises ``TypeError``). Checked here, before any counter
    runs, so every counter refuses the same texts: the heuristic one would count it.
    """
    if text.isascii():  # ASCII holds no surrogate
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidField(
            f"{field!r} is not valid Unicode: a lone surrogate (U+{ord(text[exc.start]):04X}) at character "
            f"{exc.start}, which no tokenizer can read. A character above U+FFFF is escaped as a pair "
            "(\\ud83d\\ude00), or sent as UTF-8.",
            field=field,
        ) from None


def _max_new_tokens(data: dict[str, Any], spec: RouteSpec) -> int:
    for name in spec.max_tokens_fields:
        raw = data.get(name)
        if raw is None:
            continue
        value = _as_int(raw)
        if value is None:
            raise InvalidField(f"{name!r} must be an integer, not {_json_type(raw)}.", field=name)
        if value < 1:
            raise InvalidField(f"{name!r} must be at least 1, got {value}.", field=name)
        if value > spec.max_new_tokens_cap:
            raise InvalidField(
                f"{name!r} is {value}; this route allows at most {spec.max_new_tokens_cap}.", field=name
            )
        return value
    return spec.default_max_new_tokens


def _n(data: dict[str, Any], spec: RouteSpec) -> int:
    if spec.batch_field is None:
        return 1
    raw = data.get(spec.batch_field)
    if raw is None:
        return 1
    value = _as_int(raw)
    if value is None or not 1 <= value <= spec.max_batch:
        raise InvalidField(
            f"{spec.batch_field!r} must be an integer from 1 to {spec.max_batch}, got {raw!r}.",
            field=spec.batch_field,
        )
    return value


def _as_int(value: Any) -> int | None:
    """The integer a pydantic ``int`` field makes of a JSON number (``16.0`` is 16), else None.

    Booleans and numeric strings, which pydantic's lax mode would also take, stay refused: a
    client sending them has most likely made a mistake worth a clear 422.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_as_int(item) is not None for item in value)


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
