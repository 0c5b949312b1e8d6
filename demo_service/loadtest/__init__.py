"""Load testing for the demo service (or any server with the same APIs).

``python -m demo_service.loadtest --help`` for the CLI; ``run_load(LoadTestConfig(...))`` in-process.
``locustfile.py`` here offers the same workload to locust users. Nothing here imports torch, and
names are imported on first use, so the locustfile (which needs only ``_workload`` and ``_retry``)
runs where httpx, tqdm and prometheus-client are not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from ._report import summarize, write_json
    from ._retry import parse_retry_after
    from ._runner import LoadResult, LoadTestConfig, RequestRecord, run_load
    from ._workload import DEFAULT_MIX, LengthClass, make_jobs, parse_mix

_WHERE = {
    "DEFAULT_MIX": "._workload",
    "LengthClass": "._workload",
    "LoadResult": "._runner",
    "LoadTestConfig": "._runner",
    "RequestRecord": "._runner",
    "make_jobs": "._workload",
    "parse_mix": "._workload",
    "parse_retry_after": "._retry",
    "run_load": "._runner",
    "summarize": "._report",
    "write_json": "._report",
}
__all__ = [
    "DEFAULT_MIX",
    "LengthClass",
    "LoadResult",
    "LoadTestConfig",
    "RequestRecord",
    "make_jobs",
    "parse_mix",
    "parse_retry_after",
    "run_load",
    "summarize",
    "write_json",
]


__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, globals(), __all__)
