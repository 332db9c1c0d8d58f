"""Progress lines for long steps, drawn by tqdm on stderr so stdout stays machine-readable.

Silent for steps that end within `quiet_for` seconds. On a terminal tqdm redraws its bar in place; elsewhere
(log files, CI output) a redrawn bar would run together into one huge line, so each update becomes a line of
its own, at most one every `log_every` seconds, e.g. `build master/cpu: 3 / 151 (2%, 02:50 left)`. A step long
enough to show progress (or given a note) ends with one line `label: note (12.3s)`. `unit="B"` counts bytes.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class _LogLines(tqdm):
    """tqdm writing each refresh as a line of its own, for a stderr that is not a terminal."""

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "":  # close() erasing the bar: nothing was drawn in place, so nothing to erase
            return False
        self.fp.write((str(self) if msg is None else msg) + "\n")
        self.fp.flush()
        return True


def _line_format(unit: str, known_total: bool) -> str:
    """tqdm bar_format of a log line. Bytes get tqdm's k/M/G prefixes and a rate; other units are written as
    given (the build's steps have none: `3 / 151`)."""
    if not known_total:
        return "{desc}: {n_fmt}" + unit + " ({elapsed})"
    rate = ", {rate_fmt}" if unit == "B" else ""
    return "{desc}: {n_fmt}" + unit + " / {total_fmt}" + unit + " ({percentage:.0f}%" + rate + ", {remaining} left)"


class Progress:
    def __init__(self, label: str, total: int | None = None, unit: str = "", *, enabled: bool = True,
                 quiet_for: float = 2.0, log_every: float = 10.0):
        self.label, self.unit, self.enabled, self.quiet_for = label, unit, enabled, quiet_for
        self.done = 0
        self.start = time.monotonic()
        self._lines = not sys.stderr.isatty()
        # miniters=1: the time alone decides when to draw (tqdm's adaptive count goes silent when steps slow down)
        self._bar = (_LogLines if self._lines else tqdm)(
            desc=label, total=total, unit=unit or "it", unit_scale=unit == "B", unit_divisor=1000,
            file=sys.stderr, disable=not enabled, leave=False, delay=quiet_for, miniters=1,
            mininterval=log_every if self._lines else 0.2, dynamic_ncols=True,
            bar_format=_line_format(unit, bool(total)) if self._lines else None)

    @property
    def total(self) -> int | None:
        return self._bar.total

    @total.setter
    def total(self, total: int | None) -> None:
        """Settable once known (ninja says its step count only with its first line)."""
        self._bar.total = total
        if self._lines:
            self._bar.bar_format = _line_format(self.unit, bool(total))

    def update(self, done: int | None = None, *, step: int = 0) -> None:
        """`done` so far, or `step` more."""
        new = self.done + step if done is None else done
        self._bar.update(new - self.done)
        self.done = new

    def finish(self, note: str | None = None) -> float:
        """End the bar and write the step's line (only if it was long enough to show progress, or has a note);
        return the seconds taken."""
        elapsed = time.monotonic() - self.start
        self._bar.close()
        if self.enabled and (note is not None or elapsed >= self.quiet_for):
            say(f"{self.label}: {note or self._amount()} ({elapsed:.1f}s)")
        return elapsed

    def _amount(self) -> str:
        if self.unit == "B":
            return tqdm.format_sizeof(self.done, suffix="B", divisor=1000)
        return f"{self.done}{self.unit}"


def say(message: str) -> None:
    """A line on stderr; on a terminal through tqdm, so that a bar being drawn is not written over."""
    if sys.stderr.isatty():
        tqdm.write(message, file=sys.stderr)
    else:
        sys.stderr.write(message + "\n")
    sys.stderr.flush()
