"""`pyllama-moe plot`: a picture of `pyllama-moe bench` results (the JSON of `--json`), drawn with matplotlib.

The default is the medians beside a forest plot of the ratios, and `--samples` is drawn here too; `--sweep`,
`--hit-rates` and `--profile` are in sweep.py, hits.py and profile.py. What each picture shows and how to read it:
docs/benchmarks.md, "`plot`".
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from pyllama_moe.errors import UserError
from pyllama_moe.plot.bench_files import _read_file

FORMATS = ("svg", "png", "pdf")
COLORS = {"baseline": "#9aa5b1", "candidate": "#2b7bba"}
NOT_CONVERGED = "#c0392b"
LOG_SPAN = 20  # medians spanning more than this factor get a log axis, or the slow rows are invisible slivers
ROW_INCHES, FRAME_INCHES, WIDTH_INCHES = 0.42, 1.9, 13.0


# --- input -------------------------------------------------------------------------------------------------

def load_tests(paths: list[Path]) -> tuple[list[dict], dict]:
    """The plottable tests of all files in order, normalized (see `_normalize`), and one meta for them all.

    A test is plottable when both medians are there: a side without kept samples has nothing to draw.
    """
    tests, metas = [], []
    for path in paths:
        meta, file_tests = _read_file(Path(path))
        metas.append(meta)
        tests += [t for t in file_tests if t["median_baseline"] and t["median_candidate"]]
    if not tests:
        raise UserError("no test with both medians in " + ", ".join(map(str, paths)),
                        "run `pyllama-moe bench --json F` first")
    return tests, _merge_meta(paths, metas)


def _merge_meta(paths: list[Path], metas: list[dict]) -> dict:
    """What all files agree on: a legend naming `master` is only true if every file compared master.

    Intervals of different confidence levels or methods in one forest plot would look comparable and are
    not, so that is refused; files without intervals (schema 1) take no part in the check.
    """
    merged = {k: v for k, v in metas[0].items() if all(m.get(k) == v for m in metas[1:])}
    for key in ("confidence", "method"):
        given = {str(p): m[key] for p, m in zip(paths, metas) if m.get(key) is not None}
        values = list(given.values())
        if any(v != values[0] for v in values[1:]):
            raise UserError(f"the files have different {key}s: " + ", ".join(f"{p}: {v}" for p, v in given.items()),
                            "plot them separately")
        merged.pop(key, None)
        if given:
            merged[key] = next(iter(given.values()))
    return merged


# --- the figure --------------------------------------------------------------------------------------------

def bench_figure(tests: list[dict], meta: dict, title: str = ""):
    """The picture of `tests` (as `load_tests` returns them) as a `matplotlib.figure.Figure`.

    Rows top to bottom in the order of `tests`; row i is at y = i on both panels (the y axis is inverted).
    No pyplot: the figure holds no global state, so callers may build many.
    """
    from matplotlib.figure import Figure

    if not tests:
        raise ValueError("bench_figure needs at least one test")
    names = (meta.get("baseline_name") or "baseline", meta.get("candidate_name") or "candidate")
    fig = Figure(figsize=(WIDTH_INCHES, FRAME_INCHES + ROW_INCHES * len(tests)), layout="constrained")
    bars, forest = fig.subplots(1, 2, sharey=True, width_ratios=(3, 2))
    _draw_medians(bars, tests, names)
    _draw_ratios(forest, tests, names)
    for ax in (bars, forest):
        _separate_files(ax, tests)
    bars.set_yticks(range(len(tests)), [t["test"] for t in tests])
    bars.set_ylim(len(tests) - 0.5, -0.5)  # first test on top, as in the files
    if title:
        fig.suptitle(title)
    fig.supxlabel(_footnote(tests, meta, names), fontsize="small", color="#555555")
    return fig


def _draw_medians(ax, tests: list[dict], names: tuple[str, str]) -> None:
    values = [t[f"median_{side}"] for t in tests for side in COLORS]
    log = max(values) / min(values) > LOG_SPAN
    # on a log axis a bar cannot start at 0: start all at a power of ten at least 2x below the slowest median,
    # so its bar stays visible
    start = 10.0 ** math.floor(math.log10(min(values) / 2)) if log else 0.0
    for k, (side, name) in enumerate(zip(COLORS, names)):
        y = [i + (k - 0.5) * 0.4 for i in range(len(tests))]  # baseline above, candidate below
        width = [t[f"median_{side}"] - start for t in tests]
        ax.barh(y, width, height=0.38, left=start, color=COLORS[side], label=name)
        for yi, t in zip(y, tests):
            ax.text(t[f"median_{side}"], yi, f" {t[f'median_{side}']:.1f}", va="center", fontsize="x-small")
    # a tenth of the axis past the longest bar, for the value printed after it
    if log:
        ax.set_xscale("log")
        ax.set_xlim(start, max(values) * (max(values) / start) ** 0.1)
    else:
        ax.set_xlim(0, max(values) * 1.1)
    ax.set_xlabel("median t/s" + (" (log scale)" if log else ""))
    _legend_above(ax)


def _draw_ratios(ax, tests: list[dict], names: tuple[str, str]) -> None:
    rows = range(len(tests))
    ax.axvline(1.0, linestyle="--", color="#777777", linewidth=1, gid="ratio-1.0")
    spans = [(i, t) for i, t in zip(rows, tests) if t["ci_low"] is not None]
    if spans:
        ax.hlines([i for i, _ in spans], [t["ci_low"] for _, t in spans], [t["ci_high"] for _, t in spans],
                  color=COLORS["candidate"], linewidth=2, gid="ratio-interval")
    excludes = [i for i, t in zip(rows, tests) if _excludes_one(t)]
    others = [i for i in rows if i not in excludes]
    marker = {"marker": "o", "linestyle": "none", "markersize": 7, "color": COLORS["candidate"]}
    if excludes:
        ax.plot([tests[i]["ratio"] for i in excludes], excludes, gid="ratio-differs",
                label="interval excludes 1.0", **marker)
    if others:
        ax.plot([tests[i]["ratio"] for i in others], others, markerfacecolor="white", gid="ratio-same",
                label="interval includes 1.0, or none", **marker)
    for i, t in zip(rows, tests):
        # y in data, x in axes coordinates: the text column stays right of the panel whatever the ratios
        ax.text(1.02, i, _row_text(t), transform=ax.get_yaxis_transform(), va="center", fontsize="small",
                color=NOT_CONVERGED if t["converged"] is False else "black", gid=f"ratio-text-{i}")
    ax.set_xlabel(f"ratio {names[1]} / {names[0]} (t/s)")
    ax.tick_params(axis="y", left=False)  # the labels are the left panel's
    _legend_above(ax)


def _legend_above(ax) -> None:
    # above the panel, not inside: inside it covers the last rows' bars or points
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1), ncols=2, frameon=False, fontsize="small")


def _excludes_one(t: dict) -> bool:
    return t["ci_low"] is not None and (t["ci_low"] > 1.0 or t["ci_high"] < 1.0)


def _row_text(t: dict) -> str:
    if t["ci_low"] is None:
        text = f"{t['ratio']:.3f} (no interval)"
    else:
        text = f"{t['ratio']:.3f} [{t['ci_low']:.3f}, {t['ci_high']:.3f}]"
    limit = t.get("limit")
    if limit:
        text += f"  share of limit {limit['share_candidate']:.2f}"
        if limit["share_low"] is not None and limit["share_high"] is not None:
            text += f" [{limit['share_low']:.2f}, {limit['share_high']:.2f}]"
    if t["converged"] is False:
        text += "  not converged"
    return text


def _separate_files(ax, tests: list[dict]) -> None:
    """A thin line where the rows of one file end and the next file's begin."""
    for i in range(1, len(tests)):
        if tests[i].get("file") != tests[i - 1].get("file"):
            ax.axhline(i - 0.5, color="#cccccc", linewidth=0.8)


def _footnote(tests: list[dict], meta: dict, names: tuple[str, str]) -> str:
    parts = [f"bars: median t/s of kept samples; points: ratio {names[1]}/{names[0]}"]
    if any(t["ci_low"] is not None for t in tests):
        level = meta.get("confidence")
        parts.append(f"lines: {level * 100:g}% interval" if level is not None else "lines: interval")
    if meta.get("method"):
        parts.append(f"method: {meta['method']}")
    return "; ".join(parts)


# --- output ------------------------------------------------------------------------------------------------

def picture_format(output: Path) -> str:
    fmt = output.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise UserError(f"{output}: unknown picture format {output.suffix or '(no suffix)'!r}",
                        "name the output " + ", ".join(f".{f}" for f in FORMATS))
    return fmt


def write_figure(fig, output: Path) -> None:
    """Save under a temporary name in the same folder, then rename: never a half-written picture at `output`."""
    from matplotlib import rc_context

    fmt = picture_format(output)
    if not output.parent.is_dir():
        raise UserError(f"folder {output.parent} does not exist", "create it or pick another -o")
    tmp = output.with_name(output.name + ".partial")
    # text stays text in the SVG (searchable, small), and without a date or random ids it diffs cleanly
    # when a result picture is committed again
    rc = {"svg.fonttype": "none", "svg.hashsalt": "pyllama-moe"}
    metadata = {"svg": {"Date": None}, "pdf": {"CreationDate": None}}.get(fmt)
    try:
        with rc_context(rc):
            fig.savefig(tmp, format=fmt, metadata=metadata, dpi=150)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)


def samples_figure(path: Path, title: str = ""):
    """Every sample of one schema-2 run in the order it was measured, one panel per test: shows what a ratio
    hides (a machine warming up, drift, one slow process) and which samples the statistics left out."""
    from matplotlib.figure import Figure

    meta, tests = _read_file(path, normalize=False)
    tests = [t for t in tests if isinstance(t, dict) and isinstance(t.get("samples"), list) and t["samples"]]
    if meta.get("schema") != 2 or not tests:
        raise UserError(f"{path} has no per-sample records (schema 2)", "pass a file that bench wrote with --json")
    names = (meta.get("baseline_name") or "baseline", meta.get("candidate_name") or "candidate")
    fig = Figure(figsize=(10, 2.4 * len(tests) + 0.8), layout="constrained")
    axes = fig.subplots(len(tests), 1, squeeze=False)[:, 0]
    for ax, test in zip(axes, tests):
        for side, name in zip(("baseline", "candidate"), names):
            for discarded in (False, True):
                pts = [(s["invocation"] + s["rep"] / (1 + max(x["rep"] for x in test["samples"])), s["ts"])
                       for s in test["samples"] if s["side"] == side and bool(s["discarded"]) == discarded]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, "o", color=COLORS[side], mfc="none" if discarded else COLORS[side],
                            label=f"{name}{' (left out)' if discarded else ''}")
        ax.set_title(test["test"], fontsize=9, loc="left")
        ax.set_ylabel("t/s")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("process (llama-bench run or paced round side) in the order measured")
    axes[0].legend(fontsize=8, ncols=4, loc="lower right")
    if title:
        fig.suptitle(title)
    return fig


def cmd_plot(args) -> int:
    from pyllama_moe.arguments import refuse_overwrite

    picture_format(args.output)  # before reading anything: a wrong -o is the cheapest mistake to report
    inputs = {f"JSON file {i + 1}": path for i, path in enumerate(args.json)}
    refuse_overwrite({"-o/--output": args.output}, {"--profile": args.profile, **inputs})
    if args.samples:
        if len(args.json) != 1:
            raise UserError("--samples draws one run", "pass one JSON file")
        write_figure(samples_figure(args.json[0], args.title or ""), args.output)
        print(f"wrote {args.output} (samples of {args.json[0]})")
        return 0
    if args.sweep:
        from pyllama_moe.plot.sweep import sweep_figure

        write_figure(sweep_figure(args.json, args.sweep, args.sweep_y, args.title or ""), args.output)
        print(f"wrote {args.output} ({args.sweep_y} against {args.sweep})")
        return 0
    if args.profile:
        from pyllama_moe.plot.profile import heat_figure, read

        if args.json:
            raise UserError("--profile draws one profile, not bench files", "drop the JSON files or --profile")
        write_figure(heat_figure(read(args.profile), args.title or ""), args.output)
        print(f"wrote {args.output} (expert use per layer of {args.profile})")
        return 0
    if not args.json:
        raise UserError("no JSON file to plot", "pass the files that `pyllama-moe bench --json` wrote, or --profile FILE")
    if args.hit_rates:
        from pyllama_moe.plot.hits import hit_rates_figure

        write_figure(hit_rates_figure(args.json, args.title or ""), args.output)
        print(f"wrote {args.output} (hit rate per layer)")
        return 0
    tests, meta = load_tests(args.json)
    write_figure(bench_figure(tests, meta, args.title or ""), args.output)
    print(f"wrote {args.output} ({len(tests)} tests)")
    return 0


def register(sub) -> None:
    from pyllama_moe.arguments import input_file, output_file

    p = sub.add_parser("plot", help="a picture (.svg, .png, .pdf) of `pyllama-moe bench --json` results")
    p.add_argument("json", nargs="*", type=input_file("bench JSON"),
                   help="JSON files written by `pyllama-moe bench --json`")
    p.add_argument("-o", "--output", type=output_file("picture"), required=True,
                   help="the picture to write; its suffix picks the format: " + ", ".join(FORMATS))
    p.add_argument("--title", help="a line above the picture")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--samples", action="store_true",
                      help="draw every sample of one run in the order measured instead of the ratios")
    what.add_argument("--sweep", metavar="FIELD",
                      help="draw one number per test against this field of the test key (e.g. n_ubatch), "
                           "a line per file and setting")
    what.add_argument("--hit-rates", action="store_true",
                      help="draw the expert cache's decode hit rate per layer of every row that has one, and the bytes "
                           "over PCIe per generated token where the rows say it")
    what.add_argument("--profile", type=input_file("profile"), metavar="FILE",
                      help="draw an expert cache profile (--moe-cache-profile FILE) as a heat map, layers x experts")
    p.add_argument("--sweep-y", choices=("ratio", "share", "ts"), default="ratio",
                   help="with --sweep: the ratio with its interval (default), the share of the --limit-row "
                        "row, or the candidate's median t/s")
    p.set_defaults(func=cmd_plot)
