"""The expert cache's hit rates beside bench rows: a decode row with the cache on says little without its hit rate.

A row's rate is the mean over the repetitions its timing keeps, so a speed and its rate come from the same
repetitions; each process's first repetition is reported apart as the cold rate, and the uploaded bytes per token
beside. See docs/benchmarks.md, "Hit-rate columns".
"""

from __future__ import annotations

import statistics

from pyllama_moe.bench.rounds import BenchResult, BenchRow, per_side


def parse_layer_rates(text: str | None) -> dict[int, float]:
    """'0=0.7500,3=0.9120' -> {0: 0.75, 3: 0.912}; empty for None or ''."""
    out = {}
    for part in (text or "").split(","):
        if part:
            il, rate = part.split("=")
            out[int(il)] = float(rate)
    return out


def side_hits(row: BenchRow, side: str) -> dict | None:
    """The hit rates of one side of a row: kept repetitions (overall and per layer) and each process's first (cold);
    the bytes over PCIe per generated token of the kept repetitions (None where the build does not report them)."""
    kept = [s for s in row.samples if s.side == side and not s.discarded and s.hit_rate is not None]
    cold = [s.hit_rate for s in row.samples if s.side == side and s.rep == 0 and s.hit_rate is not None]
    if not kept:
        return None
    per_layer: dict[int, list[float]] = {}
    for s in kept:
        for il, rate in parse_layer_rates(s.layer_hit_rates).items():
            per_layer.setdefault(il, []).append(rate)
    uploads = [s.upload_bytes for s in kept if s.upload_bytes is not None]
    n_gen = row.fields.get("n_gen") or 0
    per_token = statistics.fmean(uploads) / n_gen if uploads and n_gen > 0 else None
    return {"hit_rate": statistics.fmean(s.hit_rate for s in kept), "repetitions": len(kept),
            "upload_bytes_per_token": per_token,
            "cold_hit_rate": statistics.fmean(cold) if cold else None,
            "layers": {il: statistics.fmean(rates) for il, rates in sorted(per_layer.items())}}


def hit_rates(result: BenchResult) -> dict[str, dict]:
    """Per row label with a cache on some side: {"hit_rate": {side: side_hits}} (for the JSON's rows)."""
    return per_side(result, side_hits, "hit_rate")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def hit_columns(hits: dict[str, dict], names: dict[str, str]) -> dict[str, dict[str, str]]:
    """Table columns: per side with a cache, the hit rate and the range over its layers."""
    cols: dict[str, dict[str, str]] = {}
    for label, entry in hits.items():
        for side, h in entry["hit_rate"].items():
            layers = list(h["layers"].values())
            spread = f" (layers {_pct(min(layers))}-{_pct(max(layers))})" if layers else ""
            cols.setdefault(label, {})[f"hit rate, {names[side]}"] = _pct(h["hit_rate"]) + spread
            if h.get("upload_bytes_per_token") is not None:
                cols[label][f"PCIe per token, {names[side]}"] = f"{h['upload_bytes_per_token'] / 2**20:.2f} MiB"
    return cols


def format_layer_hits(hits: dict[str, dict], names: dict[str, str]) -> str:
    """One line per row and side: the hit rate of every cached layer, and the cold rate of each process's first
    repetition."""
    lines = []
    for label, entry in hits.items():
        for side, h in entry["hit_rate"].items():
            layers = " ".join(f"{il}:{100 * rate:.0f}" for il, rate in h["layers"].items())
            cold = f"; cold (first repetitions) {_pct(h['cold_hit_rate'])}" if h["cold_hit_rate"] is not None else ""
            lines.append(f"hit rate per layer (%), {label}, {names[side]}: {layers}{cold}")
    return "\n".join(lines)
