"""The start-up log: what the demo is doing, and how long each step took.

Steps log to the ``demo_service`` logger; ``python -m demo_service`` prints them on stderr, an app
served with ``uvicorn --factory`` shows them when the host configures logging for that logger.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("demo_service")


@contextmanager
def step(what: str) -> Iterator[None]:
    """Log ``what`` when it starts and, with the seconds it took, when it is done."""
    logger.info("%s ...", what)
    started = time.perf_counter()
    yield
    logger.info("%s: done in %.1f s", what, time.perf_counter() - started)


def log_to_stderr(level: str) -> None:
    """Show the demo's own log lines on stderr, in uvicorn's format (``INFO:     ...``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
