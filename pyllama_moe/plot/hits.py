"""`pyllama-moe plot --hit-rates`: the expert cache's decode hit rate per layer, from `pyllama-moe bench --json`
files whose rows carry one (`bench/hits.py`), or a patched llama-bench's own `-o json`.

A layer whose line sags routes more widely and is where a budget helps most; a second panel shows what the rates
cost in bytes over PCIe per token. See docs/benchmarks.md, "`plot`", "Hit rates".
"""

from __future__ import annotations

from pathlib import Path

import statistics

from pyllama_moe.bench.hits import parse_layer_rates
from pyllama_moe.errors import UserError
from pyllama_moe.plot.bench_files import NOT_BENCH, NOT_BENCH_FIX, _read_file, llama_bench_records


def _llama_bench_hits(path: Path) -> list[tuple[str, list[tuple[int, float]], float, float | None]] | None:
    """hit_series of a llama-bench `-o json` file (a list of records), or None if it is not one."""
    data = llama_bench_records(path)
    if data is None:
        return None
    out = []
    for r in data:
        rates = r.get("samples_moe_cache_hit_rate") or []
        warm = list(range(1, len(rates))) or list(range(len(rates)))  # the first repetition is cold
        warm = [i for i in warm if rates[i] >= 0]
        if not warm:
            continue
        layers = [parse_layer_rates(r["samples_moe_cache_layer_hit_rates"][i]) for i in warm]
        mean_layers = sorted((il, statistics.fmean(lr[il] for lr in layers if il in lr)) for il in set().union(*layers))
        uploads = r.get("samples_moe_cache_upload_bytes") or []
        n_gen = r.get("n_gen") or 0
        per_token = statistics.fmean(uploads[i] for i in warm) / n_gen if len(uploads) == len(rates) and n_gen > 0 else None
        label = f"pp{r.get('n_prompt')} tg{n_gen} mcm{r.get('moe_cache_mib')}"
        out.append((label, mean_layers, statistics.fmean(rates[i] for i in warm), per_token))
    return out


def hit_series(path: Path) -> list[tuple[str, list[tuple[int, float]], float, float | None]]:
    """(label, [(layer, rate)], overall rate, bytes over PCIe per token or None) for every row and side of one bench
    file (or of each record of a llama-bench `-o json` file) that has hit rates."""
    own = _llama_bench_hits(Path(path))
    if own is not None:
        return own
    meta, tests = _read_file(Path(path), normalize=False)
    names = {"baseline": meta.get("baseline_name") or "baseline", "candidate": meta.get("candidate_name") or "candidate"}
    out = []
    try:
        for t in tests:
            for side, h in (t.get("hit_rate") or {}).items():
                layers = sorted((int(il), float(rate)) for il, rate in h["layers"].items())
                per_token = h.get("upload_bytes_per_token")
                out.append((f"{t['test']}, {names.get(side, side)}", layers, float(h["hit_rate"]),
                            None if per_token is None else float(per_token)))
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise UserError(f"{path} {NOT_BENCH} with hit rates per layer ({exc})", NOT_BENCH_FIX) from exc
    return out


def hit_rates_figure(paths: list[Path], title: str = ""):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    series = [(Path(p).name if len(paths) > 1 else "", s) for p in paths for s in hit_series(Path(p))]
    if not series:
        raise UserError("no row of " + ", ".join(str(p) for p in paths) + " has a cache hit rate",
                        "bench a patched build with the cache on (e.g. --candidate-env LLAMA_MOE_CACHE_MIB=7800); "
                        "its llama-bench reports the rates")
    transfers = [(file_name, label, per_token) for file_name, (label, _, _, per_token) in series if per_token is not None]
    fig = Figure(figsize=(15 if transfers else 10, 4.5), layout="constrained")
    if transfers:
        ax, bars = fig.subplots(1, 2, width_ratios=(2, 1))
        names = [f"{f}: {label}" if f else label for f, label, _ in transfers]
        values = [per_token / 2**20 for _, _, per_token in transfers]
        bars.barh(range(len(values)), values, color="tab:orange")
        bars.set_yticks(range(len(values)), names, fontsize=8)
        bars.invert_yaxis()
        for i, v in enumerate(values):
            bars.annotate(f"{v:.2f}", (v, i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        bars.set_xlabel("MiB over PCIe per generated token (decode uploads)")
        bars.grid(axis="x", alpha=0.3)
    else:
        ax = fig.subplots()
    for file_name, (label, layers, overall, _) in series:
        xs, ys = zip(*layers) if layers else ((), ())
        prefix = f"{file_name}: " if file_name else ""
        ax.plot(xs, ys, "o-", markersize=3, linewidth=1, label=f"{prefix}{label} ({100 * overall:.1f}%)")
    ax.set_xlabel("layer")
    ax.set_ylabel("decode hit rate (kept repetitions)")
    ax.set_ylim(0, 1.02)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    if title:
        fig.suptitle(title)
    return fig
