"""Load testing for the demo service (or any server with the same APIs).

``python -m demo_service.loadtest --help`` for the CLI; ``run_load(LoadTestConfig(...))`` in-process.
``locustfile.py`` here offers the same workload to locust users. Nothing here imports torch.
"""

from ._report import summarize, write_json
from ._runner import LoadResult, LoadTestConfig, RequestRecord, parse_retry_after, run_load
from ._workload import DEFAULT_MIX, LengthClass, make_jobs, parse_mix

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
