"""``python -m demo_service [--host ...] [--port ...] [--model-path ...] [--int8] ...``: serve the demo.

Every flag is also a ``DEMO_*`` environment variable (``MODEL_PATH`` for the checkpoint); flags win.
Without a checkpoint the tiny local CPU model is created on first start (a progress bar shows it).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic_settings import CliApp


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    from gpu_asgi import configure_tracing

    from ._app import create_app
    from ._settings import DemoSettings

    settings = CliApp.run(DemoSettings, cli_args=list(argv) if argv is not None else None)
    provider = configure_tracing(service_name="gpu_asgi-demo") if settings.tracing else None
    app = create_app(settings, tracer_provider=provider)
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)
    finally:
        if provider is not None:
            provider.shutdown()  # flush the last spans


if __name__ == "__main__":
    main()
