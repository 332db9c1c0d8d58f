"""Progress lines for long steps, on stderr so stdout stays machine-readable.

On a terminal the line is redrawn in place; elsewhere (CI logs) a line is printed at most every few seconds.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int | None = None, unit: str = "", min_interval: float = 5.0):
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self.start = time.monotonic()
        self._tty = sys.stderr.isatty()
        self._last = 0.0
        self._interval = 0.2 if self._tty else min_interval

    def _text(self) -> str:
        elapsed = time.monotonic() - self.start
        if self.total:
            pct = 100.0 * self.done / self.total
            return f"{self.label}: {self.done}/{self.total}{self.unit} ({pct:.0f}%, {elapsed:.0f}s)"
        return f"{self.label}: {self.done}{self.unit} ({elapsed:.0f}s)"

    def update(self, done: int | None = None, *, step: int = 0, note: str = "") -> None:
        self.done = self.done + step if done is None else done
        now = time.monotonic()
        if now - self._last < self._interval:
            return
        self._last = now
        text = self._text() + (f" {note}" if note else "")
        if self._tty:
            sys.stderr.write("\r\033[K" + text[:200])
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def finish(self, note: str = "done") -> None:
        text = f"{self.label}: {note} ({time.monotonic() - self.start:.1f}s)"
        sys.stderr.write(("\r\033[K" if self._tty else "") + text + "\n")
        sys.stderr.flush()


def say(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
