"""A one-line progress display on stderr that stays silent for jobs that finish within a few seconds."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


class Progress:
    def __init__(self, label: str, total: int, *, enabled: bool = True, quiet_for: float = 2.0,
                 every: float = 0.5, stream: TextIO | None = None):
        self.label, self.total, self.enabled = label, max(1, total), enabled
        self.quiet_for, self.every = quiet_for, every
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = time.monotonic()
        self._last = 0.0
        self._shown = False

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if not self.enabled or now - self.start < self.quiet_for or now - self._last < self.every:
            return
        self._last = now
        elapsed = now - self.start
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        tty = getattr(self.stream, "isatty", lambda: False)()
        line = (f"{self.label}: {_gb(self.done)} / {_gb(self.total)} ({100 * self.done / self.total:.0f}%), "
                f"{rate / 1e6:.0f} MB/s, {int(eta) // 60}:{int(eta) % 60:02d} left")
        # on a terminal redraw one line; in a log write a line at most every 10 s
        if tty:
            self.stream.write("\r" + line + "\x1b[K")
        elif now - getattr(self, "_logged", 0.0) >= 10.0:
            self._logged = now
            self.stream.write(line + "\n")
        else:
            return
        self.stream.flush()
        self._shown = True

    def finish(self) -> float:
        elapsed = time.monotonic() - self.start
        if self._shown:
            self.stream.write(f"\r{self.label}: {_gb(self.done)} in {elapsed:.1f} s\x1b[K\n"
                              if getattr(self.stream, "isatty", lambda: False)()
                              else f"{self.label}: {_gb(self.done)} in {elapsed:.1f} s\n")
            self.stream.flush()
        return elapsed
