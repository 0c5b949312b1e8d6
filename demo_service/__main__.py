"""``python -m demo_service [--host ...] [--port ...] [--model-path ...] [--int8] ...``: serve the demo.

Every flag is also a ``DEMO_*`` environment variable (``MODEL_PATH`` for the checkpoint); flags win.
Without a checkpoint the tiny local CPU model is created on first start (a progress bar shows it).
Arguments are parsed before torch and transformers are imported, so ``--help`` answers at once.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    from pydantic_settings import CliApp

    from ._settings import DemoSettings
    from ._startup import log_to_stderr, step

    settings = CliApp.run(DemoSettings, cli_args=list(argv) if argv is not None else None)
    log_to_stderr(settings.log_level)
    with step("importing torch, transformers and the app"):
        import uvicorn

        from ._app import create_app
        from ._model.local import ModelDirInUse
    try:
        app = create_app(settings)
    except ModelDirInUse as error:
        raise SystemExit(f"error: {error}") from None
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)


if __name__ == "__main__":
    main()
