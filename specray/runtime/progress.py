"""Live progress of a run: samples done / total, samples per second, ETA, retries.

On a terminal it is a tqdm bar (done/total, samples/s, ETA, retries); otherwise
(Ray job logs, CI, a redirected stderr) it is a plain line every
``log_interval_s`` seconds (default 15, or ``SPECRAY_PROGRESS_INTERVAL_S``), at
every retry and at the end, so the job logs show progress too. "Samples" counts
rows: one generated image of one arm.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from datetime import timedelta

from tqdm import tqdm

log = logging.getLogger("specray.progress")


class Progress:
    def __init__(self, total: int, already_done: int = 0, *, enabled: bool = True,
                 log_interval_s: float | None = None, stream=None):
        if log_interval_s is None:
            log_interval_s = float(os.environ.get("SPECRAY_PROGRESS_INTERVAL_S", 15.0))
        self.total = total
        self.done = already_done
        self.initial = already_done
        self.retries = 0
        self.enabled = enabled
        self.log_interval_s = log_interval_s
        self.stream = stream or sys.stderr
        self._started = time.monotonic()
        self._last_line = float("-inf")  # the first tick prints
        self._bar: tqdm | None = None
        if enabled and _is_tty(self.stream):
            self._bar = tqdm(total=total, initial=already_done, unit="sample", dynamic_ncols=True,
                             file=self.stream, smoothing=0.1, postfix={"retries": 0})

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def advance(self, rows: int) -> None:
        self.done += rows
        if self._bar is not None:
            self._bar.update(rows)
        self.tick()

    def retry(self) -> None:
        self.retries += 1
        if self._bar is not None:
            self._bar.set_postfix(retries=self.retries)
        self.tick(force=True)

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self._started
        return (self.done - self.initial) / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        rate = self.rate
        left = self.total - self.done
        eta = str(timedelta(seconds=round(left / rate))) if rate > 0 else "?"
        percent = 100.0 * self.done / self.total if self.total else 100.0
        return (f"progress: {self.done}/{self.total} samples ({percent:.1f}%) | {rate:.1f} samples/s | "
                f"ETA {eta} | retries {self.retries}")

    def tick(self, force: bool = False) -> None:
        """Emit a log line when due (the bar refreshes itself)."""
        if not self.enabled or self._bar is not None:
            return
        now = time.monotonic()
        if force or now - self._last_line >= self.log_interval_s:
            self._last_line = now
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.enabled:
            print(self.line(), file=self.stream, flush=True)


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except Exception:
        return False
