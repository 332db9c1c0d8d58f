"""`pyllama-moe plot --sweep FIELD`: one number of each test against a setting, e.g. the ratio against the ubatch
size, to see where a curve crosses 1.0 or goes flat.

A series is the tests of one file that agree on every setting but FIELD; llama-bench's own `-o json` is read too.
See docs/benchmarks.md, "`plot`", "Sweeps".
"""

from __future__ import annotations

import json
from pathlib import Path

from pyllama_moe.errors import UserError
from pyllama_moe.plot.bench_files import NOT_BENCH, NOT_BENCH_FIX, _read_file, llama_bench_records

# what a point is: (title of the y axis, the value, its interval's low and high)
MEASURES = {
    "ratio": "ratio candidate / baseline (t/s)",
    "share": "candidate's share of its limit row",
    "ts": "candidate t/s (median)",
}
LOG2_SPAN = 8  # x values spanning more than this factor get a base-2 axis (ubatch sizes, budgets)


# the fields of a llama-bench record that are its measurement, not its settings
LLAMA_BENCH_RESULTS = {"avg_ns", "stddev_ns", "avg_ts", "stddev_ts", "samples_ns", "samples_ts", "test_time",
                       "moe_cache_hit_rate", "moe_cache_layer_hit_rates", "samples_moe_cache_hit_rate",
                       "samples_moe_cache_layer_hit_rates", "samples_moe_cache_upload_bytes",
                       "moe_cache_layer_cold_misses", "samples_moe_cache_cold_misses"}


def sweep_series(path: Path, field: str, measure: str) -> dict[str, list[tuple[float, float, float | None, float | None]]]:
    """Per series label, its points (x, y, low, high) sorted by x, from one `bench --json` file or one
    llama-bench `-o json` file."""
    tests = _llama_bench_tests(Path(path), measure)
    if tests is None:
        _, tests = _read_file(Path(path), normalize=False)  # refuses what is not a bench file, with one message
    try:
        groups: dict[tuple, list] = {}
        for t in tests:
            key = t["key"]
            if field not in key:
                raise UserError(f"{path}: test {t['test']!r} has no field {field!r}",
                                "sweep over a field of the test key: " + ", ".join(sorted(key)))
            x = key[field]
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise UserError(f"{path}: {field} of test {t['test']!r} is {x!r}, not a number",
                                "sweep over a numeric field")
            point = _point(t, measure)
            if point is not None:
                rest = tuple(sorted((k, json.dumps(v)) for k, v in key.items() if k != field))
                groups.setdefault(rest, []).append((float(x), *point))
    except (KeyError, ValueError, TypeError, AttributeError) as exc:  # e.g. a schema 1 file: its tests have no key
        raise UserError(f"{path} {NOT_BENCH} with test keys (schema 2) ({exc})", NOT_BENCH_FIX) from exc
    return {_series_label(Path(path), rest, groups): sorted(points) for rest, points in groups.items()}


def _llama_bench_tests(path: Path, measure: str) -> list[dict] | None:
    """The records of a llama-bench `-o json` file as tests with a key and a median, or None if it is not one."""
    data = llama_bench_records(path)
    if data is None:
        return None
    if measure != "ts":
        raise UserError(f"{path} is llama-bench output of one build: it has t/s, no {measure}",
                        "use --sweep-y ts, or A/B the builds with `pyllama-moe bench --json`")
    tests = []
    for r in data:
        samples = sorted(float(v) for v in r["samples_ts"])
        if not samples:
            continue
        mid = len(samples) // 2
        median = samples[mid] if len(samples) % 2 else (samples[mid - 1] + samples[mid]) / 2
        key = {k: v for k, v in r.items() if k not in LLAMA_BENCH_RESULTS}
        tests.append({"test": f"pp{r.get('n_prompt')} tg{r.get('n_gen')}", "key": key, "median_candidate": median,
                      "ts_low": samples[0], "ts_high": samples[-1]})
    return tests


def _point(t: dict, measure: str) -> tuple[float, float | None, float | None] | None:
    if measure == "ratio":
        value, low, high = t.get("ratio"), t.get("ci_low"), t.get("ci_high")
    elif measure == "share":
        limit = t.get("limit") or {}
        value, low, high = limit.get("share_candidate"), limit.get("share_low"), limit.get("share_high")
    else:  # the range of the samples where a llama-bench file gives them, else no bar
        value, low, high = t.get("median_candidate"), t.get("ts_low"), t.get("ts_high")
    if value is None:
        return None  # the limit row itself, or a side with nothing kept
    return float(value), low, high


def _series_label(path: Path, rest: tuple, groups: dict) -> str:
    """The file's name, and where a file holds several series, the settings that tell them apart."""
    if len(groups) == 1:
        return path.stem
    differing = [k for k, v in rest if any(dict(other).get(k) != v for other in groups)]
    return path.stem + " " + " ".join(f"{k}={json.loads(dict(rest)[k])}" for k in differing)


def sweep_figure(paths: list[Path], field: str, measure: str = "ratio", title: str = ""):
    from matplotlib.figure import Figure

    if measure not in MEASURES:
        raise UserError(f"unknown measure {measure!r}", "use " + ", ".join(MEASURES))
    series = {}
    for path in paths:
        series.update(sweep_series(path, field, measure))
    if not series:
        raise UserError(f"no test of {', '.join(map(str, paths))} has a {measure}", "see --sweep-y")
    fig = Figure(figsize=(8, 4.8), layout="constrained")
    ax = fig.subplots()
    xs = [x for points in series.values() for x, *_ in points]
    if min(xs) > 0 and max(xs) / min(xs) > LOG2_SPAN:
        ax.set_xscale("log", base=2)
    for i, (label, points) in enumerate(series.items()):
        x, y, low, high = zip(*points)
        err = [[v - lo if lo is not None else 0 for v, lo in zip(y, low)],
               [hi - v if hi is not None else 0 for v, hi in zip(y, high)]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=label, gid=f"sweep-{i}")
    if measure == "ratio":
        ax.axhline(1.0, linestyle="--", color="#777777", linewidth=1, gid="sweep-1.0")
    ax.set_xticks(sorted(set(xs)), [f"{v:g}" for v in sorted(set(xs))])
    ax.set_xlabel(field)
    ax.set_ylabel(MEASURES[measure])
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return fig
