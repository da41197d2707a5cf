"""Live progress of a run (or of the reducer): rows done / total, rows per second, ETA, retries.

On a terminal it is a tqdm bar, and log records are written above it instead of through it. Anywhere
else (``tee``, Ray job logs, CI, a redirected stderr) it is plain lines, never a redrawn bar: one when
the count moved and at least ``log_interval_s`` seconds (default 15, or
``SPECRAY_PROGRESS_INTERVAL_S``) passed since the last (a stalled count only every fourth
interval), one at every retry and one at the end.
The generation actors report every batch of every arm, so the count moves once per batch.
"Samples" counts rows: one generated image of one arm.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from datetime import timedelta

from tqdm import tqdm

log = logging.getLogger("specray.progress")


class Progress:
    def __init__(self, total: int, already_done: int = 0, *, enabled: bool = True,
                 log_interval_s: float | None = None, stream=None, what: str = "progress", unit: str = "samples"):
        if log_interval_s is None:
            log_interval_s = float(os.environ.get("SPECRAY_PROGRESS_INTERVAL_S", 15.0))
        self.total = total
        self.done = already_done
        self.initial = already_done
        self.retries = 0
        self.enabled = enabled
        self.log_interval_s = log_interval_s
        self.stream = stream or sys.stderr
        self.what = what
        self.unit = unit
        self._started = time.monotonic()
        self._last_line = float("-inf")  # the first tick prints
        self._last_done = None
        self._bar: tqdm | None = None
        self._redirect = contextlib.ExitStack()
        if enabled and _is_tty(self.stream):
            self._bar = tqdm(total=total, initial=already_done, unit=unit.rstrip("s"), dynamic_ncols=True,
                             file=self.stream, smoothing=0.1, desc=what, postfix={"retries": 0})
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._redirect.enter_context(logging_redirect_tqdm())  # log lines above the bar, not through it

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def advance(self, rows: int) -> None:
        self.done += rows
        if self._bar is not None:
            self._bar.update(rows)
        self.tick()

    def retract(self, rows: int) -> None:
        """Take back rows counted for work that failed and will run again."""
        self.done -= rows
        if self._bar is not None:
            self._bar.update(-rows)

    def retry(self) -> None:
        self.retries += 1
        if self._bar is not None:
            self._bar.set_postfix(retries=self.retries)
        self.tick(force=True)

    def note(self, message: str) -> None:
        """A line of its own (above the bar on a terminal)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self._started
        return (self.done - self.initial) / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        rate = self.rate
        left = self.total - self.done
        eta = str(timedelta(seconds=round(left / rate))) if rate > 0 else "?"
        percent = 100.0 * self.done / self.total if self.total else 100.0
        text = (f"{self.what}: {self.done}/{self.total} {self.unit} ({percent:.1f}%) | {rate:.1f} {self.unit}/s | "
                f"ETA {eta}")
        return text + (f" | retries {self.retries}" if self.what == "progress" else "")

    def tick(self, force: bool = False) -> None:
        """Emit a plain line when the count moved and one is due (the bar refreshes itself)."""
        if not self.enabled or self._bar is not None:
            return
        now = time.monotonic()
        moved = self.done != self._last_done
        since = now - self._last_line
        # a line when the count moved; a stalled count is repeated only now and then (a heartbeat)
        if force or (since >= self.log_interval_s and (moved or since >= 4 * self.log_interval_s)):
            self._last_line = now
            self._last_done = self.done
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._redirect.close()
        if self.enabled:
            print(self.line(), file=self.stream, flush=True)


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except Exception:
        return False
