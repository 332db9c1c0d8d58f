"""`pyllama-moe plot`: an SVG picture of `pyllama-moe bench` results (the JSON of `--json`).

One row per test: the baseline and candidate medians as two horizontal bars (t/s, one scale for the whole
picture), the ratio at the right. Plain SVG text, no plotting library, so it renders in any browser and in a
repository's file view.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from pyllama_moe.errors import UserError

ROW, BAR, LABEL_W, BARS_W, RATIO_W = 34, 12, 330, 420, 70
COLORS = {"baseline": "#9aa5b1", "candidate": "#2b7bba"}


def load_tests(paths: list[Path]) -> list[dict]:
    tests = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
            tests += [t for t in data["tests"] if t.get("median_baseline") and t.get("median_candidate")]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{path} is not the JSON of `pyllama-moe bench --json` ({exc})",
                            "pass the files that bench wrote with --json") from exc
    if not tests:
        raise UserError("no test with both medians in " + ", ".join(map(str, paths)), "run `pyllama-moe bench --json F` first")
    return tests


def bench_svg(tests: list[dict], title: str = "") -> str:
    top = 40 if title else 16
    height = top + ROW * len(tests) + 40
    width = LABEL_W + BARS_W + RATIO_W + 20
    scale = BARS_W / max(max(t["median_baseline"], t["median_candidate"]) for t in tests)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    if title:
        out.append(f'<text x="10" y="22" font-size="14" font-weight="bold">{escape(title)}</text>')
    for i, t in enumerate(tests):
        y = top + i * ROW
        out.append(f'<text x="{LABEL_W - 8}" y="{y + BAR + 4}" text-anchor="end">{escape(t["test"])}</text>')
        for k, side in enumerate(("baseline", "candidate")):
            value = t[f"median_{side}"]
            out.append(f'<rect x="{LABEL_W}" y="{y + k * BAR}" width="{value * scale:.1f}" height="{BAR - 1}" '
                       f'fill="{COLORS[side]}"><title>{side}: {value:.1f} t/s</title></rect>')
        ratio = t["median_candidate"] / t["median_baseline"]
        out.append(f'<text x="{LABEL_W + BARS_W + 8}" y="{y + BAR + 4}">{ratio:.3f}x</text>')
    legend_y = top + ROW * len(tests) + 16
    for k, side in enumerate(("baseline", "candidate")):
        x = LABEL_W + k * 140
        out.append(f'<rect x="{x}" y="{legend_y}" width="12" height="12" fill="{COLORS[side]}"/>')
        out.append(f'<text x="{x + 18}" y="{legend_y + 11}">{side} (median t/s)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def cmd_plot(args) -> int:
    tests = load_tests(args.json)
    tmp = args.output.with_name(args.output.name + ".partial")
    tmp.write_text(bench_svg(tests, args.title or ""))
    tmp.replace(args.output)  # never a half-written picture under the final name
    print(f"wrote {args.output} ({len(tests)} tests)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("plot", help="an SVG bar chart of `pyllama-moe bench --json` results")
    p.add_argument("json", nargs="+", type=Path, help="JSON files written by `pyllama-moe bench --json`")
    p.add_argument("-o", "--output", type=Path, required=True, help="the SVG file to write")
    p.add_argument("--title", help="a line above the chart")
    p.set_defaults(func=cmd_plot)
