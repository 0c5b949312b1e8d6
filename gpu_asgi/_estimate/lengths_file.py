"""Learned lengths kept across restarts: a warm start for a new process of the same model.

A fresh server has learnt nothing and so reserves every answer's declared limit (strict) until 16
answers of a route have ended: after a restart or a scale-up, under load, that is the burst a
cold server serves worst. :class:`LengthsFile` writes :meth:`OutputLengths.snapshot` to a JSON file
every ``interval`` seconds and when it stops, and a new process restores it at startup under a
conservative rule (docs/admission.md, "Warm start"): only a file written for the same model
(``model``: its name and anything that changes what its answers are), no older than ``max_age``,
of this format; anything else is ignored with a warning, never an error that stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .lengths import OutputLengths

logger = logging.getLogger("gpu_asgi.lengths")

FORMAT = 1
#: A day: answers learnt longer ago than that may be of other traffic, another prompt or release.
DEFAULT_MAX_AGE = 86_400.0
DEFAULT_INTERVAL = 30.0


class LengthsFile:
    """``lengths`` saved to ``path`` and restored from it, for ``model``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        lengths: OutputLengths,
        *,
        model: str,
        max_age: float = DEFAULT_MAX_AGE,
        interval: float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.lengths = lengths
        self.model = model
        self.max_age = max_age
        self.interval = interval
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    def load(self) -> int:
        """Restore the file's lengths if it fits (same model and format, not older than
        ``max_age``); the answers taken (0: none, a missing file included)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as error:
            logger.warning("learned lengths in %s not read: %s; starting cold", self.path, error)
            return 0
        why = self._unfit(data)
        if why is not None:
            logger.warning("learned lengths in %s not used: %s; starting cold", self.path, why)
            return 0
        try:
            taken = self.lengths.restore(data["lengths"])
        except ValueError as error:
            logger.warning("learned lengths in %s not used: %s; starting cold", self.path, error)
            return 0
        logger.info("learned lengths restored from %s: %d answers of %s", self.path, taken, self.model)
        return taken

    def _unfit(self, data: object) -> str | None:
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("lengths"), list):
            return f"not a learned-lengths file of format {FORMAT}"
        if data.get("model") != self.model:
            return f"written for model {data.get('model')!r}, not {self.model!r}"
        saved = data.get("saved_at")
        if not isinstance(saved, int | float) or not 0 <= self._clock() - saved <= self.max_age:
            return f"older than {self.max_age:g} s (or from the future)"
        return None

    def save(self) -> None:
        """Write the snapshot, whole or not at all (a temporary file renamed over the old one)."""
        data = {"format": FORMAT, "model": self.model, "saved_at": self._clock(), "lengths": self.lengths.snapshot()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=self.path.name, suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(data, out, separators=(",", ":"))
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    def start(self) -> None:
        """Save every ``interval`` seconds, in a worker thread (the file may be a few MB)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="gpu_asgi learned lengths file")

    async def stop(self) -> None:
        """Stop saving on the timer, and save once more: what the last answers taught."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._save_logged()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self._save_logged()

    async def _save_logged(self) -> None:
        try:
            await asyncio.to_thread(self.save)
        except OSError as error:  # a full disk must not stop the server; the next save may work
            logger.warning("learned lengths not saved to %s: %s", self.path, error)
