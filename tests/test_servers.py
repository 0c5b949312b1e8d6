"""Server matrix: the core behaviours through uvicorn, hypercorn and granian, each a real process.

Each server serves ``tests._server_app:app`` on 127.0.0.1 (a free port) for the whole module;
the test talks HTTP/1.1 over raw sockets (so it decides when a client leaves) and reads the
ledger through the app's untagged ``/stats`` route. Every process is killed in ``finally``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
APP = "tests._server_app:app"
STARTUP_TIMEOUT = 60.0  # a loaded machine starts a server slowly; nothing here depends on it

SERVERS: dict[str, Callable[[int], list[str]]] = {
    "uvicorn": lambda port: [sys.executable, "-m", "uvicorn", APP, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
    "hypercorn": lambda port: [sys.executable, "-m", "hypercorn", APP, "--bind", f"127.0.0.1:{port}", "--log-level", "warning"],
    "granian": lambda port: [sys.executable, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", APP],
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start(
    command: list[str], port: int, log: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """The server, once it listens on ``port``; ``env`` is added to the environment it inherits."""
    environment = {**os.environ, **(env or {})}
    with log.open("wb") as output:  # a file, not a pipe: readable while the server runs, never full
        process = subprocess.Popen(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, env=environment)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{command[2]} exited at startup ({process.returncode}):\n{log.read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process
        except OSError:
            time.sleep(0.1)
    stop(process)
    raise AssertionError(f"{command[2]} did not listen on {port} within {STARTUP_TIMEOUT} s")


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


@pytest.fixture(scope="module", params=sorted(SERVERS))
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    log = tmp_path_factory.mktemp(request.param) / "server.log"
    process = start(SERVERS[request.param](port), port, log)
    try:
        yield Server(port, log)
    finally:
        stop(process)


class Server:
    def __init__(self, port: int, log: Path) -> None:
        self.port = port
        self.log = log
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)

    def stats(self) -> dict[str, Any]:
        return self.http.get("/stats").json()  # type: ignore[no-any-return]

    def open(self, gate: str) -> None:
        assert self.http.post(f"/open/{gate}").status_code == 200

    def post(self, path: str, payload: dict[str, Any]) -> socket.socket:
        """Send a request on a fresh connection and leave the answer to the caller."""
        body = json.dumps(payload).encode()
        head = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
        connection = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        connection.sendall(head.encode() + body)
        return connection

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0) -> float:
        """Seconds until ``predicate(stats)`` holds."""
        started = time.monotonic()
        while not predicate(self.stats()):
            assert time.monotonic() - started < timeout, self.stats()
            time.sleep(0.01)
        return time.monotonic() - started


def read_until(connection: socket.socket, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = connection.recv(4096)
        assert chunk, f"connection closed before {marker!r}: {data!r}"
        data += chunk
    return data


def read_to_end(connection: socket.socket) -> bytes:
    data = b""
    while chunk := connection.recv(4096):
        data += chunk
    return data


def test_a_streamed_response_holds_its_bytes_to_the_last_chunk(server: Server) -> None:
    gate = uuid.uuid4().hex
    connection = server.post("/stream", {"prompt": "a b", "max_new_tokens": 5, "gate": gate, "chunks": 3})
    with connection:
        assert read_until(connection, b"first ").startswith(b"HTTP/1.1 200")
        assert (server.stats()["reserved"], server.stats()["in_flight"]) == (7, 1), "held while streaming"
        server.open(gate)
        assert read_to_end(connection).count(b"token ") == 2
    server.wait_for(lambda stats: stats["reserved"] == 0 and stats["in_flight"] == 0)


def test_a_disconnect_mid_stream_returns_the_bytes_within_a_second(server: Server) -> None:
    connection = server.post("/stream", {"prompt": "a b", "max_new_tokens": 5, "forever": True})
    read_until(connection, b"first ")
    assert server.stats()["reserved"] == 7
    connection.close()
    assert server.wait_for(lambda stats: stats["reserved"] == 0 and stats["in_flight"] == 0) < 1.0


def test_a_client_that_leaves_while_queued_is_never_admitted(server: Server) -> None:
    before = server.stats()
    gate = uuid.uuid4().hex
    holder = server.post("/stream", {"prompt": "a", "max_new_tokens": 99, "gate": gate})  # the whole budget
    with holder:
        read_until(holder, b"first ")
        queued = server.post("/count", {"prompt": "a", "max_new_tokens": 99})
        server.wait_for(lambda stats: stats["waiting"] == 1)
        queued.close()  # gives up while queued
        server.wait_for(lambda stats: stats["waiting"] == 0)
        server.open(gate)
        read_to_end(holder)
    after = server.stats()
    assert after["calls"].get("count", 0) == before["calls"].get("count", 0), "the endpoint never ran"
    assert after["admitted"] == before["admitted"] + 1, "only the holder was admitted"
    server.wait_for(lambda stats: stats["reserved"] == 0)
    # The departed client's 499 went to a closed connection: every server takes it quietly.
    assert "Traceback" not in server.log.read_text(errors="replace")


def test_a_refusal_is_our_problem_and_leaves_no_traceback_in_the_server_log(server: Server) -> None:
    refused = server.http.post("/count", json={"prompt": 42})
    too_big = server.http.post("/count", json={"prompt": "a", "max_new_tokens": 1000})  # more than the budget
    assert (refused.status_code, too_big.status_code) == (422, 413)
    assert refused.headers["content-type"] == too_big.headers["content-type"] == "application/problem+json"
    time.sleep(0.2)  # let the server flush whatever it would log
    assert "Traceback" not in server.log.read_text(errors="replace")


def test_hypercorn_with_trio_refuses_to_start_and_says_why() -> None:
    port = free_port()
    command = [*SERVERS["hypercorn"](port), "--worker-class", "trio"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = process.communicate(timeout=STARTUP_TIMEOUT)  # it exits: it never serves a request
    finally:
        if process.poll() is None:
            stop(process)
    assert b"Lifespan failure in startup" in output and b"asyncio only" in output
