"""Progress lines for long steps, on stderr so stdout stays machine-readable.

Silent for steps that end within `quiet_for` seconds. On a terminal the line is redrawn in place; elsewhere
(CI logs) a line is written at most every `log_every` seconds. With a total, the line shows the share done, the
rate and the time left; `unit="B"` formats counts as bytes.
"""

from __future__ import annotations

import sys
import time


def _amount(n: float, unit: str) -> str:
    if unit == "B":
        return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
    return f"{int(n)}{unit}"


class Progress:
    def __init__(self, label: str, total: int | None = None, unit: str = "", *, enabled: bool = True,
                 quiet_for: float = 2.0, log_every: float = 10.0):
        self.label, self.total, self.unit, self.enabled = label, total, unit, enabled
        self.quiet_for, self.log_every = quiet_for, log_every
        self.done = 0
        self.start = time.monotonic()
        self._tty = sys.stderr.isatty()
        self._last = 0.0
        self._shown = False

    def _line(self, elapsed: float) -> str:
        done = _amount(self.done, self.unit)
        if not self.total:
            return f"{self.label}: {done} ({elapsed:.0f}s)"
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        speed = f", {rate / 1e6:.0f} MB/s" if self.unit == "B" else ""
        return (f"{self.label}: {done} / {_amount(self.total, self.unit)} ({100 * self.done / self.total:.0f}%"
                f"{speed}, {int(left) // 60}:{int(left) % 60:02d} left)")

    def update(self, done: int | None = None, *, step: int = 0) -> None:
        self.done = self.done + step if done is None else done
        now = time.monotonic()
        elapsed = now - self.start
        interval = 0.2 if self._tty else self.log_every
        if not self.enabled or elapsed < self.quiet_for or now - self._last < interval:
            return
        self._last = now
        sys.stderr.write(("\r\033[K" + self._line(elapsed)[:200]) if self._tty else self._line(elapsed) + "\n")
        sys.stderr.flush()
        self._shown = True

    def finish(self, note: str | None = None) -> float:
        """End the line (printed only if the step was long enough to show progress); return the seconds taken."""
        elapsed = time.monotonic() - self.start
        if self.enabled and (self._shown or note is not None):
            text = f"{self.label}: {note or _amount(self.done, self.unit)} ({elapsed:.1f}s)"
            sys.stderr.write(("\r\033[K" if self._tty else "") + text + "\n")
            sys.stderr.flush()
        return elapsed


def say(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
