"""Token ids to text, one generated sequence at a time: streaming deltas and stop strings.

Byte-level BPE splits multi-byte characters across tokens, so a prefix of the ids can decode to a
trailing U+FFFD that the next token turns into a real character: such a tail is held back until it
settles. Text that could still become a stop string is held back too, so a stream never shows a
stop string, or part of one, that the final text does not contain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"


class SequenceText:
    """The text of one generated sequence as its tokens arrive.

    ``incremental=False`` decodes once, in :meth:`finish`; use it when nobody reads the deltas and
    there are no stop strings (it keeps the event loop free of per-token decoding).
    """

    __slots__ = ("_decode", "_emitted", "_hold", "_incremental", "_stop", "stopped", "text", "token_ids")

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), *, incremental: bool = True) -> None:
        self._decode = tokenizer.decode
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._incremental = incremental or bool(self._stop)
        self.token_ids: list[int] = []
        #: The text so far, cut before a stop string once one appeared.
        self.text = ""
        self._emitted = 0
        #: A stop string appeared: the sequence is complete.
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that became safe to show."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        if not self._incremental:
            return ""
        self.text = self._decode(self.token_ids, skip_special_tokens=True)
        if self._stop and self._find_stop():
            return self._take(len(self.text))
        settled = len(self.text.rstrip(REPLACEMENT))
        return self._take(min(settled, len(self.text) - self._hold))

    def finish(self) -> str:
        """The sequence ended: return whatever was held back."""
        if not self._incremental:
            self.text = self._decode(self.token_ids, skip_special_tokens=True)
        return self._take(len(self.text))

    def _find_stop(self) -> bool:
        # Only the new tail can complete a stop string; search from just before it.
        start = max(0, self._emitted - self._hold)
        cut = min((i for s in self._stop if (i := self.text.find(s, start)) >= 0), default=-1)
        if cut < 0:
            return False
        self.text = self.text[:cut]
        self.stopped = True
        return True

    def _take(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
