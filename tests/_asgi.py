"""Test helpers: an in-process HTTP client, a raw ASGI driver for streaming and disconnect tests
(ASGITransport buffers), waiting helpers, a word-count token counter and a local Hugging Face
tokenizer."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import Callable
from typing import Any

import httpx

from gpu_asgi._types import ASGIApp, Message


def http_scope(path: str = "/generate", *, method: str = "POST", headers: list[tuple[bytes, bytes]] | None = None, app: Any = None) -> dict[str, Any]:
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers if headers is not None else [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
    if app is not None:
        scope["app"] = app
    return scope


class RawClient:
    """Drives one ASGI request by hand: body chunks in, messages out, disconnect on demand."""

    def __init__(self, app: ASGIApp, scope: dict[str, Any], chunks: list[bytes]) -> None:
        self.app = app
        self.scope = scope
        self.incoming: asyncio.Queue[Message] = asyncio.Queue()
        for index, chunk in enumerate(chunks):
            self.incoming.put_nowait({"type": "http.request", "body": chunk, "more_body": index < len(chunks) - 1})
        self.sent: list[Message] = []
        self.got_message = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def receive(self) -> Message:
        return await self.incoming.get()

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        self.got_message.set()

    def start(self) -> RawClient:
        self.task = asyncio.ensure_future(self.app(self.scope, self.receive, self.send))
        return self

    def disconnect(self) -> None:
        self.incoming.put_nowait({"type": "http.disconnect"})

    async def finish(self, timeout: float = 30.0) -> None:
        assert self.task is not None
        await asyncio.wait_for(self.task, timeout)

    @property
    def status(self) -> int | None:
        for message in self.sent:
            if message["type"] == "http.response.start":
                return int(message["status"])
        return None

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    def json(self) -> Any:
        return json.loads(self.body)

    def header(self, name: bytes) -> bytes | None:
        for message in self.sent:
            if message["type"] == "http.response.start":
                return dict(message["headers"]).get(name)
        return None


def in_threads(target: Callable[[], object], count: int, timeout: float) -> None:
    """Run ``target`` in ``count`` threads at once (each its own event loop, as ``asyncio.run`` makes)."""
    threads = [threading.Thread(target=target) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)


async def settle(rounds: int = 20) -> None:
    """Let every ready task run (the loop is the only thing moving in these tests)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


#: Generous on purpose: a wait returns as soon as its condition holds, so only a failing test pays
#: it, and a busy machine (other processes on two cores) must not turn a slow pass into a failure.
DEFAULT_WAIT = 30.0


async def wait_until(predicate: Callable[[], bool], timeout: float = DEFAULT_WAIT) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.001)


def client(app: Any) -> httpx.AsyncClient:
    """An HTTP client that calls ``app`` in process (no server, no socket)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


class Words:
    """A token counter for tests: one token per whitespace-separated word."""

    inline_limit = 1 << 30

    def count(self, text: str) -> int:
        return len(text.split())


@functools.cache
def local_hf_tokenizer() -> Any:
    """A real Hugging Face fast tokenizer (byte-level BPE, as Qwen's and Llama 3's are), trained
    here on a few words: nothing is downloaded, and the Rust encoder is the one a hub model has."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend)
