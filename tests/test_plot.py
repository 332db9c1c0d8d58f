"""`pyllama-moe plot`: an SVG of bench results, two bars per test on one scale, the ratio beside them."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from pyllama_moe.errors import UserError
from pyllama_moe.plot import bench_svg, load_tests

NS = "{http://www.w3.org/2000/svg}"


def _bench_json(path, tests):
    path.write_text(json.dumps({"meta": {}, "tests": tests}))
    return path


def test_svg_bars_scale_and_ratio(tmp_path):
    f = _bench_json(tmp_path / "b.json", [
        {"test": "pp4096 ub2048", "median_baseline": 4000.0, "median_candidate": 6000.0},
        {"test": "tg128", "median_baseline": 40.0, "median_candidate": 42.0},
        {"test": "skipped: no candidate", "median_baseline": 1.0, "median_candidate": None},
    ])
    svg = ET.fromstring(bench_svg(load_tests([f]), "title & more"))
    bars = [r for r in svg.iter(f"{NS}rect") if r.find(f"{NS}title") is not None]
    assert len(bars) == 4  # two per test with both medians
    widths = [float(b.get("width")) for b in bars]
    assert widths[1] == max(widths) and abs(widths[0] / widths[1] - 4000 / 6000) < 1e-3  # one scale
    texts = [t.text for t in svg.iter(f"{NS}text")]
    assert "1.500x" in texts and "1.050x" in texts and "title & more" in texts


def test_plot_cli_writes_atomically_and_refuses_bad_input(tmp_path):
    f = _bench_json(tmp_path / "b.json", [{"test": "pp512", "median_baseline": 10.0, "median_candidate": 11.0}])
    out = tmp_path / "b.svg"
    proc = subprocess.run([sys.executable, "-m", "pyllama_moe", "plot", str(f), "-o", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0 and out.is_file() and not (tmp_path / "b.svg.partial").exists()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = subprocess.run([sys.executable, "-m", "pyllama_moe", "plot", str(bad), "-o", str(tmp_path / "c.svg")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "is not the JSON of `pyllama-moe bench --json`" in proc.stderr
    assert not (tmp_path / "c.svg").exists()
    with pytest.raises(UserError):
        load_tests([_bench_json(tmp_path / "empty.json", [])])
