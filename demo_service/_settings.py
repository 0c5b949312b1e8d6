"""``DemoSettings``: every knob of the demo service, read from the environment and the command line.

This is the one place the demo reads its configuration: ``DEMO_*`` environment variables (plus
``MODEL_PATH``), overridden by command-line flags in ``python -m demo_service`` (kebab-case:
``DEMO_BATCH_WINDOW_MS=5`` and ``--batch-window-ms 5`` are the same setting). Constructing
``DemoSettings(...)`` in Python reads the environment too; pass values to override it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BeforeValidator, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: The default CPU budget: small on purpose, so that a handful of long requests fill it and the
#: demo shows queueing, 503s and Retry-After (about four 1,000-token prompts with 256 new tokens,
#: or thirty short chat turns, fit at once). A real GPU's budget is derived from the device.
DEFAULT_CPU_BUDGET_BYTES = 256 * 2**20
DEFAULT_RUNTIME_OVERHEAD_BYTES = 2**30


def _status_code(value: Any) -> Any:
    # Environment variables and flags arrive as strings, and pydantic compares a Literal[429, 503]
    # strictly: "429" would be refused. Whole numbers in text become ints; the Literal checks the rest.
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


RejectStatus = Annotated[Literal[429, 503], BeforeValidator(_status_code)]


class DemoSettings(BaseSettings):
    """Settings of the demo service (``DEMO_*`` environment variables, or CLI flags)."""

    model_config = SettingsConfigDict(
        env_prefix="DEMO_",
        cli_prog_name="python -m demo_service",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        frozen=True,
    )

    # -- serving -----------------------------------------------------------------------------
    host: str = Field(default="127.0.0.1", description="Address to bind.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port to bind (0: any free port).")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        default="info", description="uvicorn's log level."
    )

    # -- the model ---------------------------------------------------------------------------
    model_path: str | None = Field(
        default=None,
        validation_alias=AliasChoices("model_path", "MODEL_PATH"),
        description="A local checkpoint (or a hub id, if you mean it). Unset: the tiny local CPU model.",
    )
    local_model_dir: Path | None = Field(
        default=None, description="Where the tiny CPU model is created on first start (default ~/.cache/gpu_asgi/...)."
    )
    served_model_name: str | None = Field(
        default=None, description="The model id in API answers (default: the folder name)."
    )
    device: str = Field(
        default="auto", description="'auto' (CUDA when there is a GPU and a checkpoint), 'cpu' or 'cuda[:N]'."
    )
    int8: bool = Field(default=False, description="CPU only: quantize the Linear layers to int8 (dynamic).")
    progress: bool = Field(default=True, description="Show progress bars while the model is created and loaded.")

    # -- admission (gpu_asgi) ----------------------------------------------------------------
    budget_bytes: int | None = Field(
        default=None,
        gt=0,
        description="Bytes requests may reserve. CPU default 256 MiB (simulated); CUDA default: derived from the device.",
    )
    gpu_utilization: float = Field(
        default=0.90, gt=0, le=1, description="CUDA: fraction of device memory the budget may use."
    )
    runtime_overhead_bytes: int = Field(
        default=DEFAULT_RUNTIME_OVERHEAD_BYTES,
        ge=0,
        description="CUDA: context and allocator slack, taken off the budget once.",
    )
    ledger_url: str | None = Field(
        default=None,
        description="Where the budget lives: unset or memory:// for this process; redis://host:port/db to share "
        "one budget between `--workers` and hosts (needs gpu_asgi[redis]).",
    )
    ledger_namespace: str = Field(
        default="gpu_asgi:demo", description="Redis ledger: the key namespace, one per physical GPU."
    )
    max_queue: int = Field(default=8, ge=0, description="Requests that may wait for memory; more get 503 queue-full.")
    max_wait: float = Field(
        default=10.0, gt=0, description="Seconds a request may wait for memory before 503 queue-timeout."
    )
    reject_status: RejectStatus = Field(default=503, description="Status for overload answers: 429 or 503.")
    drain_timeout: float = Field(
        default=25.0, ge=0,
        description="On SIGTERM: seconds admitted requests may take to finish (keep below the server's "
        "graceful timeout and Kubernetes' terminationGracePeriodSeconds).",
    )
    drain_delay: float = Field(
        default=0.0, ge=0,
        description="On SIGTERM: seconds between the drain (readiness 503, new GPU requests refused) and the "
        "server closing its listener, so load balancers see the replica go first.",
    )
    reserve: str = Field(
        default="strict",
        description="What a request reserves: 'strict' (prompt + max_tokens: no batch ever waits to grow), "
        "'learned' (prompt + the 0.9 quantile of the lengths answers really had; a batch that runs past it "
        "pauses for the bytes) or a quantile in (0, 1).",
    )
    max_new_tokens_cap: int = Field(
        default=1024, ge=1, description="Largest max_tokens / max_new_tokens a request may ask for."
    )
    default_max_new_tokens: int = Field(
        default=128, ge=1, description="/v1/generate and chat: tokens generated when unasked."
    )

    # -- dynamic batching --------------------------------------------------------------------
    batch_window_ms: float = Field(
        default=10.0, ge=0, description="How long the batcher collects requests after the first one."
    )
    max_batch_size: int = Field(
        default=16, ge=1, description="Most sequences in one generate call (1 turns batching off)."
    )

    # -- telemetry ---------------------------------------------------------------------------
    tracing: bool = Field(
        default=False, description="Export spans with OTLP, configured by the standard OTEL_* variables."
    )

    @property
    def reserve_quantile(self) -> float | None:
        """The quantile of learned lengths that requests reserve; None: strict."""
        return _reserve_quantile(self.reserve)

    @model_validator(mode="after")
    def _check(self) -> DemoSettings:
        _reserve_quantile(self.reserve)
        if self.default_max_new_tokens > self.max_new_tokens_cap:
            raise ValueError("default_max_new_tokens must not exceed max_new_tokens_cap")
        if self.int8 and self.device.startswith("cuda"):
            raise ValueError("int8 is CPU-only; on CUDA load an AWQ checkpoint instead")
        return self


#: ``reserve=learned``: what ``gpu_asgi.OutputLengths`` reserves by default.
LEARNED_QUANTILE = 0.9


def _reserve_quantile(text: str) -> float | None:
    if text == "strict":
        return None
    if text == "learned":
        return LEARNED_QUANTILE
    try:
        quantile = float(text)
    except ValueError:
        quantile = -1.0
    if not 0 < quantile < 1:
        raise ValueError(f"reserve must be 'strict', 'learned' or a quantile in (0, 1), got {text!r}")
    return quantile
