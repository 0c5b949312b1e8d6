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
    from ._batching import Batcher
    from ._buckets import BucketedEstimator, bucket
    from ._generation import Sampling
    from ._model import LoadedModel, ensure_local_model, load_model
    from ._settings import DemoSettings

_WHERE = {
    "Batcher": "._batching",
    "BucketedEstimator": "._buckets",
    "DemoSettings": "._settings",
    "LoadedModel": "._model",
    "Sampling": "._generation",
    "bucket": "._buckets",
    "create_app": "._app",
    "ensure_local_model": "._model",
    "load_model": "._model",
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
