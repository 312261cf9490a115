"""Progress lines for long steps that print nothing of their own (a model conversion, a build stage).

No step that runs longer than about 10 s should be silent, also when stderr is not a terminal (a log file, CI,
``| tee``), where progress bars are off: :class:`Heartbeat` prints one line every :data:`HEARTBEAT_S` seconds
while a step runs (``[trtllm-diffkv] ... still converting the model (20 s)``), from a daemon thread, and
nothing once the step ended.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time

__all__ = ["Heartbeat", "heartbeat", "HEARTBEAT_S"]

HEARTBEAT_S = 10.0
"""Seconds between two heartbeat lines."""


class Heartbeat:
    """Prints ``{prefix} ... still {what} ({seconds} s)`` every ``every_s`` seconds between :meth:`start` and
    :meth:`stop` (one step at a time; :meth:`start` of the next step ends the last).

    Args:
        prefix: the line's start, e.g. ``"[trtllm-diffkv]"``.
        every_s: seconds between lines (> 0).
        file: where the lines go (``None``: ``sys.stderr`` at each line, so a redirected stderr is followed).
    """

    def __init__(self, prefix: str = "[trtllm-diffkv]", every_s: float = HEARTBEAT_S, file=None):
        if not every_s > 0:
            raise ValueError(f"every_s={every_s!r} must be > 0")
        self.prefix, self.every_s, self.file = prefix, every_s, file
        self._stop: threading.Event | None = None

    def start(self, what: str) -> None:
        """Start the lines for step ``what`` (stopping those of the step before)."""
        self.stop()
        stop = self._stop = threading.Event()
        began = time.monotonic()

        def beat():
            while not stop.wait(self.every_s):
                print(f"{self.prefix} ... still {what} ({time.monotonic() - began:.0f} s)",
                      file=self.file if self.file is not None else sys.stderr, flush=True)

        threading.Thread(target=beat, name="trtllm-diffkv-heartbeat", daemon=True).start()

    def stop(self) -> None:
        """No more lines (idempotent)."""
        if self._stop is not None:
            self._stop.set()
            self._stop = None


@contextlib.contextmanager
def heartbeat(what: str, prefix: str = "[trtllm-diffkv]", every_s: float = HEARTBEAT_S, file=None):
    """A :class:`Heartbeat` for the ``with`` block's step ``what``."""
    beat = Heartbeat(prefix, every_s, file)
    beat.start(what)
    try:
        yield beat
    finally:
        beat.stop()
