"""Demo service for gpu_asgi: a FastAPI app serving Qwen2 behind the admission middleware.

``python -m demo_service`` (or ``gpu-asgi-demo``) serves it; ``create_app(DemoSettings(...))``
builds the app in-process. ``python -m demo_service.loadtest`` drives it with concurrent clients.

Names are imported on first use, so the load tester (``demo_service.loadtest``) runs without
importing torch or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_attributes

if TYPE_CHECKING:
    from ._app import create_app
    from ._batching.batcher import Batcher
    from ._batching.buckets import BucketedEstimator, bucket
    from ._batching.device_run import Sampling
    from ._model.load import LoadedModel, ensure_local_model, load_model
    from ._settings import DemoSettings

_WHERE = {
    "Batcher": "._batching.batcher",
    "BucketedEstimator": "._batching.buckets",
    "DemoSettings": "._settings",
    "LoadedModel": "._model.load",
    "Sampling": "._batching.device_run",
    "bucket": "._batching.buckets",
    "create_app": "._app",
    "ensure_local_model": "._model.load",
    "load_model": "._model.load",
}
__all__ = [
    "Batcher",
    "BucketedEstimator",
    "DemoSettings",
    "LoadedModel",
    "Sampling",
    "bucket",
    "create_app",
    "ensure_local_model",
    "load_model",
]


__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, globals(), __all__)
