"""ASGI type aliases, and the marker that makes a plain ``__call__`` read as an ASGI 3 app."""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

F = TypeVar("F", bound=Callable[..., Any])


def mark_coroutine_function(func: F) -> F:
    """Make ``iscoroutinefunction`` true for ``func``, a plain function that returns an awaitable.

    Servers (uvicorn, hypercorn) tell ASGI 3 from ASGI 2 with ``iscoroutinefunction(app.__call__)``:
    ``inspect``'s from Python 3.12 honours ``markcoroutinefunction``, ``asyncio``'s on 3.11 an
    ``_is_coroutine`` attribute.
    """
    if sys.version_info >= (3, 12):
        return inspect.markcoroutinefunction(func)
    func._is_coroutine = asyncio.coroutines._is_coroutine  # type: ignore[attr-defined]
    return func
