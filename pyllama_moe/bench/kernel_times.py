"""Kernel durations from an Nsight Compute CSV (`ncu --csv --metrics gpu__time_duration.sum`), per kernel name:
where a decode step's GPU time goes, e.g. the expert cache's lookup and fill kernels per layer and token. ncu
serializes kernels, so these are each kernel's own time, not a step's wall time (docs/benchmarks.md)."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass

# ncu's time units, in microseconds
_UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
METRIC = "gpu__time_duration.sum"


@dataclass
class KernelTime:
    name: str
    launches: int
    total_us: float

    @property
    def mean_us(self) -> float:
        return self.total_us / self.launches


def kernel_name(full: str) -> str:
    """'moe_cache_lookup_kernel(const int *, int)' -> 'moe_cache_lookup_kernel'; templates keep their arguments."""
    depth = 0
    for i, ch in enumerate(full):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0:
            return full[:i].strip()
    return full.strip()


def parse(text: str) -> list[KernelTime]:
    """Per kernel name, the launches and their summed duration, most time first. Lines that are not CSV rows (ncu's
    ==PROF== messages, the program's own output) are skipped; a row of another metric is ignored."""
    rows = [line for line in text.splitlines() if line.startswith('"')]
    if not rows:
        return []
    times: dict[str, KernelTime] = {}
    for row in csv.DictReader(io.StringIO("\n".join(rows))):
        if row.get("Metric Name") != METRIC:
            continue
        unit = _UNITS.get((row.get("Metric Unit") or "").strip())
        if unit is None:
            raise ValueError(f"unknown unit {row.get('Metric Unit')!r} of {METRIC}")
        us = float(row["Metric Value"].replace(",", "")) * unit
        name = kernel_name(row["Kernel Name"])
        kt = times.setdefault(name, KernelTime(name, 0, 0.0))
        kt.launches += 1
        kt.total_us += us
    return sorted(times.values(), key=lambda k: -k.total_us)


def table(times: list[KernelTime], tokens: int | None = None, layers: int | None = None) -> str:
    """A Markdown table: launches, mean and total µs per kernel, and µs per token (and per layer and token) where the
    run's token and cached layer counts are given."""
    head = "| kernel | launches | mean µs | total µs |"
    per = []
    if tokens:
        head += " µs per token |"
        per.append(lambda k: k.total_us / tokens)
        if layers:
            head += " µs per layer and token |"
            per.append(lambda k: k.total_us / tokens / layers)
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for k in times:
        cells = [k.name, str(k.launches), f"{k.mean_us:.2f}", f"{k.total_us:.1f}"] + [f"{f(k):.2f}" for f in per]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
