"""`pyllama-moe plot`: medians as bars and the ratio with its interval as a forest plot, drawn with matplotlib."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from PIL import Image  # matplotlib's own dependency

from pyllama_moe.cli.main import main
from pyllama_moe.errors import UserError
from pyllama_moe.plot import main as plot
from pyllama_moe.plot.main import bench_figure, load_tests

META2 = {"schema": 2, "baseline": "/b/master-cuda-1", "candidate": "/b/patched-cuda-2", "baseline_name": "master",
         "candidate_name": "patched", "confidence": 0.95, "method": "paired t"}


def _test2(label, base, cand, ratio, low, high, n_pairs=8, converged=None, limit=None):
    return {"test": label, "median_baseline": base, "median_candidate": cand, "ratio": ratio, "ci_low": low,
            "ci_high": high, "n_pairs": n_pairs, "converged": converged, "limit": limit, "pcie_bound_ts": None,
            "pcie_share_candidate": None,
            "samples": [{"side": "baseline", "round": 0, "invocation": 0, "rep": 0, "ts": base or 1.0, "discarded": True}]}


def _schema2(path, tests, **meta):
    path.write_text(json.dumps({"meta": {**META2, **meta}, "tests": tests}))
    return path


def _schema1(path, rows):
    """Like the JSON `bench` wrote before its schema 2 (2026-11-30): no schema, no names, no intervals."""
    tests = [{"test": label, "median_baseline": b, "median_candidate": c, "ratio": c / b, "spread_baseline": 0.05,
              "spread_candidate": 0.08, "samples": {"baseline": [b] * 3, "candidate": [c] * 3}} for label, b, c in rows]
    path.write_text(json.dumps({"meta": {"model": "m.gguf", "baseline": "/b/1", "candidate": "/b/2", "rounds": 2,
                                         "reps": 5}, "tests": tests}))
    return path


LIMIT = {"row": "pp512 ncmoe0", "share_candidate": 0.93, "share_low": 0.91, "share_high": 0.95, "share_baseline": 0.8}


@pytest.fixture
def mixed(tmp_path):
    """Four rows that plot (one of each kind of interval) and one that cannot (no candidate sample)."""
    return _schema2(tmp_path / "s2.json", [
        _test2("tg128 same", 38.2, 39.0, 1.021, 0.995, 1.048, converged=True),
        _test2("pp512 faster", 1422.5, 1742.9, 1.225, 1.20, 1.25, converged=False, limit=LIMIT),
        _test2("tg128 no candidate", 30.0, None, None, None, None, n_pairs=0),
        _test2("pp512 one pair", 8248.6, 8233.8, 0.998, 0.99, 1.01, n_pairs=1),
        _test2("pp512 slower", 900.0, 800.0, 0.889, 0.85, 0.93),
    ])


def _panels(fig):
    bars, forest = fig.axes[:2]
    return bars, forest


def _by_gid(ax, gid):
    found = [a for a in ax.get_children() if a.get_gid() == gid]
    assert len(found) <= 1, gid
    return found[0] if found else None


def _row_texts(forest):
    return {int(t.get_gid().rsplit("-", 1)[1]): t for t in forest.texts if (t.get_gid() or "").startswith("ratio-text-")}


def test_one_row_per_plotted_test_with_its_interval(mixed):
    tests, meta = load_tests([mixed])
    fig = bench_figure(tests, meta, "a title")
    bars, forest = _panels(fig)
    labels = ["tg128 same", "pp512 faster", "pp512 one pair", "pp512 slower"]
    assert [t.get_text() for t in bars.get_yticklabels()] == labels
    assert list(bars.get_yticks()) == [0, 1, 2, 3]
    assert bars.get_ylim() == (3.5, -0.5)  # first row on top
    assert forest.get_shared_y_axes().joined(bars, forest)
    assert fig.get_suptitle() == "a title"

    # the interval lines are exactly [ci_low, ci_high] on the row of their test; one pair gives none
    segments = [seg.tolist() for seg in _by_gid(forest, "ratio-interval").get_segments()]
    assert segments == [[[0.995, 0], [1.048, 0]], [[1.20, 1], [1.25, 1]], [[0.85, 3], [0.93, 3]]]
    ref = _by_gid(forest, "ratio-1.0")
    assert list(ref.get_xdata()) == [1.0, 1.0] and ref.get_linestyle() == "--"

    # filled where the interval excludes 1.0 (faster and slower), hollow where it includes it or there is none
    differs, same = _by_gid(forest, "ratio-differs"), _by_gid(forest, "ratio-same")
    assert list(differs.get_xdata()) == [1.225, 0.889] and list(differs.get_ydata()) == [1, 3]
    assert list(same.get_xdata()) == [1.021, 0.998] and list(same.get_ydata()) == [0, 2]
    assert same.get_markerfacecolor() == "white" and differs.get_markerfacecolor() != "white"


def test_row_texts_name_interval_limit_share_and_convergence(mixed):
    bars, forest = _panels(bench_figure(*load_tests([mixed])))
    texts = _row_texts(forest)
    assert [texts[i].get_text() for i in range(4)] == [
        "1.021 [0.995, 1.048]",
        "1.225 [1.200, 1.250]  share of limit 0.93 [0.91, 0.95]  not converged",
        "0.998 (no interval)",
        "0.889 [0.850, 0.930]",
    ]
    assert texts[1].get_color() == plot.NOT_CONVERGED and texts[0].get_color() == "black"
    assert [t.get_text() for t in bars.get_legend().get_texts()] == ["master", "patched"]


def test_footnote_has_confidence_and_method(tmp_path, mixed):
    fig = bench_figure(*load_tests([mixed]))
    assert "95% interval" in fig.get_supxlabel() and "method: paired t" in fig.get_supxlabel()
    other = _schema2(tmp_path / "o.json", [_test2("x", 10.0, 11.0, 1.1, 1.05, 1.15)], confidence=0.9, method=None)
    note = bench_figure(*load_tests([other])).get_supxlabel()
    assert "90% interval" in note and "method" not in note


def test_schema1_plots_without_intervals(tmp_path):
    f = _schema1(tmp_path / "old.json", [("pp4096 ub2048", 4243.5, 6277.6), ("pp4096 ub4096", 12170.0, 11571.9)])
    tests, meta = load_tests([f])
    assert [(t["ratio"], t["ci_low"], t["ci_high"], t["converged"]) for t in tests] == [
        (pytest.approx(6277.6 / 4243.5), None, None, None), (pytest.approx(11571.9 / 12170.0), None, None, None)]
    bars, forest = _panels(bench_figure(tests, meta))
    assert _by_gid(forest, "ratio-interval") is None and _by_gid(forest, "ratio-differs") is None
    assert [t.get_text() for t in _row_texts(forest).values()] == ["1.479 (no interval)", "0.951 (no interval)"]
    assert [t.get_text() for t in bars.get_legend().get_texts()] == ["baseline", "candidate"]
    assert bars.get_xscale() == "linear"  # 4243..12170 is less than a factor 20


def test_bars_are_the_medians_on_a_log_axis_when_they_span_much(tmp_path):
    f = _schema2(tmp_path / "s.json", [_test2("tg", 38.0, 40.0, 1.05, 1.0, 1.1), _test2("pp", 4000.0, 6000.0, 1.5, 1.4, 1.6)])
    bars, _ = _panels(bench_figure(*load_tests([f])))
    assert bars.get_xscale() == "log"
    containers = {c.get_label(): c for c in bars.containers}  # one bar container per build, labelled by its name
    for name, medians in (("master", [38.0, 4000.0]), ("patched", [40.0, 6000.0])):
        rects = containers[name].patches
        assert [r.get_x() + r.get_width() for r in rects] == pytest.approx(medians)
        assert all(r.get_x() == 10.0 for r in rects)  # a power of ten below the slowest median, not 0


def test_files_stack_in_order_and_the_figure_grows_with_rows(tmp_path):
    a = _schema2(tmp_path / "a.json", [_test2("a1", 10.0, 11.0, 1.1, 1.0, 1.2), _test2("a2", 10.0, 9.0, 0.9, 0.8, 1.0)])
    b = _schema1(tmp_path / "b.json", [("b1", 20.0, 21.0)])
    tests, meta = load_tests([b, a])
    assert [t["test"] for t in tests] == ["b1", "a1", "a2"]
    assert "baseline_name" not in meta and meta["confidence"] == 0.95  # names: b.json does not say its builds
    small = bench_figure(*load_tests([b]))
    big = bench_figure(tests, meta)
    assert [t.get_text() for t in big.axes[0].get_yticklabels()] == ["b1", "a1", "a2"]
    assert big.get_size_inches()[1] > small.get_size_inches()[1]


def test_files_with_different_confidence_levels_are_refused(tmp_path):
    a = _schema2(tmp_path / "a.json", [_test2("a1", 10.0, 11.0, 1.1, 1.0, 1.2)])
    b = _schema2(tmp_path / "b.json", [_test2("b1", 10.0, 11.0, 1.1, 1.0, 1.2)], confidence=0.9)
    with pytest.raises(UserError, match="different confidences.*plot them separately"):
        load_tests([a, b])


def test_svg_is_written_atomically_and_parses(tmp_path, mixed, monkeypatch, capsys):
    out = tmp_path / "b.svg"
    real_replace = plot.os.replace
    seen = {}

    def replace(src, dst):  # at the moment of the rename: complete picture aside, nothing at the final name
        seen.update(src=src, dst=dst, final_existed=out.exists(), tmp=ET.parse(src).getroot().tag)
        real_replace(src, dst)

    monkeypatch.setattr(plot.os, "replace", replace)
    assert main(["plot", str(mixed), "-o", str(out), "--title", "t & more"]) == 0
    assert seen["dst"] == out and seen["src"] != out and seen["src"].parent == out.parent
    assert not seen["final_existed"] and seen["tmp"] == "{http://www.w3.org/2000/svg}svg"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.svg", "s2.json"]  # no temporary left
    texts = {"".join(e.itertext()) for e in ET.parse(out).getroot().iter("{http://www.w3.org/2000/svg}text")}
    assert {"tg128 same", "pp512 slower", "t & more", "1.021 [0.995, 1.048]"} <= texts  # text stays text
    assert "wrote" in capsys.readouterr().out


def test_a_failed_write_keeps_the_old_picture(tmp_path):
    out = tmp_path / "b.svg"
    out.write_text("old picture")

    class Broken:
        def savefig(self, path, **kw):
            path.write_text("<svg half")
            raise OSError("disk full")

    with pytest.raises(OSError):
        plot.write_figure(Broken(), out)
    assert out.read_text() == "old picture" and [p.name for p in tmp_path.iterdir()] == ["b.svg"]


def _png_size(path):
    with Image.open(path) as image:
        assert image.format == "PNG"
        return image.size


def test_png_and_pdf_follow_the_suffix(tmp_path, mixed):
    one = _schema1(tmp_path / "one.json", [("x", 10.0, 11.0)])
    assert main(["plot", str(mixed), "-o", str(tmp_path / "four.png")]) == 0
    assert main(["plot", str(one), "-o", str(tmp_path / "one.PNG")]) == 0
    (w4, h4), (w1, h1) = _png_size(tmp_path / "four.png"), _png_size(tmp_path / "one.PNG")
    assert w4 == w1 and h4 > h1
    assert main(["plot", str(one), "-o", str(tmp_path / "one.pdf")]) == 0
    assert (tmp_path / "one.pdf").read_bytes()[:5] == b"%PDF-"


def test_unknown_suffix_is_refused_before_anything_is_written(tmp_path, mixed, capsys):
    assert main(["plot", str(mixed), "-o", str(tmp_path / "b.jpeg")]) == 2
    err = capsys.readouterr().err
    assert "unknown picture format '.jpeg'" in err and ".svg, .png, .pdf" in err
    assert main(["plot", str(mixed), "-o", str(tmp_path / "b")]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["plot", str(bad), "-o", str(tmp_path / "b.jpg")]) == 2
    assert "unknown picture format '.jpg'" in capsys.readouterr().err  # the suffix is checked first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "s2.json"]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pyllama_moe", "plot", *map(str, args)], capture_output=True, text=True)


def test_bad_json_and_empty_input_exit_2(tmp_path):
    out = tmp_path / "c.svg"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = _cli(bad, "-o", out)
    assert proc.returncode == 2
    assert f"{bad} is not the JSON of `pyllama-moe bench --json`" in proc.stderr
    assert "pass the files that bench wrote with --json" in proc.stderr
    wrong = _schema2(tmp_path / "wrong.json", [_test2("x", "fast", 11.0, 1.1, 1.0, 1.2)])
    proc = _cli(wrong, "-o", out)
    assert proc.returncode == 2 and "wrong.json is not the JSON of" in proc.stderr and "'fast'" in proc.stderr
    empty = _schema2(tmp_path / "empty.json", [_test2("no candidate", 10.0, None, None, None, None, n_pairs=0)])
    proc = _cli(empty, "-o", out)
    assert proc.returncode == 2 and f"no test with both medians in {empty}" in proc.stderr
    assert not out.exists()


def test_samples_figure_draws_every_sample_of_a_run(tmp_path):
    samples = [{"side": side, "round": r, "invocation": 2 * r + (side == "candidate"), "rep": rep,
                "ts": 40.0 + r + rep, "discarded": rep == 0} for r in range(3) for side in ("baseline", "candidate")
               for rep in range(3)]
    two = [{**_test2(label, 40.0, 41.0, 1.02, 1.0, 1.04), "samples": samples} for label in ("tg128 a", "tg128 b")]
    fig = plot.samples_figure(_schema2(tmp_path / "run.json", two), "a run")
    assert [ax.get_title(loc="left") for ax in fig.axes] == ["tg128 a", "tg128 b"]
    for ax in fig.axes:
        hollow = [line for line in ax.get_lines() if line.get_markerfacecolor() == "none"]
        filled = [line for line in ax.get_lines() if line.get_markerfacecolor() != "none"]
        assert sum(len(line.get_ydata()) for line in hollow) == 6  # one left-out warm-up per process
        assert sorted(y for line in filled for y in line.get_ydata()) == sorted(
            s["ts"] for s in samples if not s["discarded"])
    with pytest.raises(UserError, match="no per-sample records"):
        plot.samples_figure(_schema1(tmp_path / "old.json", [("pp512", 10.0, 11.0)]))


def _swept(label, ub, ratio, low, high, ncmoe=48, limit=None):
    t = _test2(label, 100.0, 100.0 * ratio, ratio, low, high, limit=limit)
    t["key"] = {"n_prompt": 512, "n_ubatch": ub, "n_cpu_moe": ncmoe, "load_mode": "none"}
    return t


def test_sweep_draws_one_line_per_file_and_setting_with_intervals(tmp_path):
    a = _schema2(tmp_path / "skew0.json", [_swept("pp512 ub32", 32, 0.8, 0.78, 0.82),
                                          _swept("pp512 ub512", 512, 1.3, 1.2, 1.4),
                                          _swept("pp512 ub128", 128, 1.05, 1.0, 1.1)])
    b = _schema2(tmp_path / "skew05.json", [_swept("pp512 ub32", 32, 0.7, 0.6, 0.8),
                                            _swept("pp512 ub32 ncmoe0", 32, 1.0, 0.99, 1.01, ncmoe=0)])
    from pyllama_moe.plot.sweep import sweep_figure, sweep_series

    assert sweep_series(a, "n_ubatch", "ratio") == {"skew0": [(32.0, 0.8, 0.78, 0.82), (128.0, 1.05, 1.0, 1.1),
                                                              (512.0, 1.3, 1.2, 1.4)]}
    assert sorted(sweep_series(b, "n_ubatch", "ratio")) == ["skew05 n_cpu_moe=0", "skew05 n_cpu_moe=48"]
    fig = sweep_figure([a, b], "n_ubatch", "ratio", "min batch")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and [t.get_text() for t in ax.get_xticklabels()] == ["32", "128", "512"]
    lines = [c for c in ax.containers if (c.get_label() or "").startswith("skew")]
    assert [c.get_label() for c in lines] == ["skew0", "skew05 n_cpu_moe=48", "skew05 n_cpu_moe=0"]  # file order
    out = tmp_path / "sweep.svg"
    assert main(["plot", str(a), str(b), "--sweep", "n_ubatch", "-o", str(out)]) == 0
    ET.parse(out)


def test_sweep_of_shares_skips_the_limit_row_and_a_bad_field_is_named(tmp_path, capsys):
    share = {"row": "ncmoe0", "share_candidate": 0.9, "share_low": 0.85, "share_high": 0.95, "share_baseline": 0.5}
    f = _schema2(tmp_path / "s.json", [_swept("ub2048", 2048, 1.5, 1.4, 1.6, limit=share),
                                       _swept("ub2048 all on the GPU", 2048, 1.0, 0.99, 1.01, ncmoe=0)])
    from pyllama_moe.plot.sweep import sweep_series

    assert sweep_series(f, "n_ubatch", "share") == {"s": [(2048.0, 0.9, 0.85, 0.95)]}
    assert main(["plot", str(f), "--sweep", "n_batch", "-o", str(tmp_path / "x.svg")]) == 2
    err = capsys.readouterr().err
    assert "has no field 'n_batch'" in err and "n_ubatch" in err
    assert not (tmp_path / "x.svg").exists()
    bad = _schema2(tmp_path / "bad.json", [_swept("ub", 512, 1.0, 0.9, 1.1)])
    data = json.loads(bad.read_text())
    data["tests"][0]["key"]["load_mode"] = "none"
    bad.write_text(json.dumps(data))
    assert main(["plot", str(bad), "--sweep", "load_mode", "-o", str(tmp_path / "y.svg")]) == 2
    assert "not a number" in capsys.readouterr().err


def test_sweep_reads_llama_bench_json_of_one_build(tmp_path, capsys):
    def record(ub, staging, samples):
        return {"n_prompt": 4096, "n_gen": 0, "n_ubatch": ub, "sched_prefetch_staging": staging,
                "test_time": f"2026-12-01T14:{staging % 60:02d}:00Z", "avg_ts": sum(samples) / len(samples),
                "stddev_ts": 1.0, "samples_ts": samples, "samples_ns": [1] * len(samples),
                # the cache's hit rates are results too (one per record here)
                "moe_cache_hit_rate": staging / 1000, "moe_cache_layer_hit_rates": f"0={staging / 1000}",
                "samples_moe_cache_hit_rate": [staging / 1000] * len(samples),
                "samples_moe_cache_layer_hit_rates": [f"0={staging / 1000}"] * len(samples),
                "samples_moe_cache_upload_bytes": [staging * 1000] * len(samples)}

    f = tmp_path / "sweep.json"
    f.write_text(json.dumps([record(4096, 216, [9818, 9810, 9823]), record(4096, 108, [6438, 6469, 6476]),
                             record(2048, 108, [4357, 4371, 4374, 4380])]))
    from pyllama_moe.plot.sweep import sweep_series

    # the test time and the hit rates differ per record and are results, not settings: one line per ubatch, not per
    # record
    assert sweep_series(f, "sched_prefetch_staging", "ts") == {
        "sweep n_ubatch=4096": [(108.0, 6469.0, 6438.0, 6476.0), (216.0, 9818.0, 9810.0, 9823.0)],
        "sweep n_ubatch=2048": [(108.0, 4372.5, 4357.0, 4380.0)]}
    assert main(["plot", str(f), "--sweep", "sched_prefetch_staging", "-o", str(tmp_path / "r.svg")]) == 2
    assert "no ratio" in capsys.readouterr().err and not (tmp_path / "r.svg").exists()
    out = tmp_path / "ts.svg"
    assert main(["plot", str(f), "--sweep", "sched_prefetch_staging", "--sweep-y", "ts", "-o", str(out)]) == 0
    ET.parse(out)


def test_hit_rates_draw_a_line_per_row_and_side_with_a_cache(tmp_path):
    with_cache = _test2("tg128 ncmoe48", 31.0, 112.0, 3.6, 3.3, 3.9)
    with_cache["hit_rate"] = {"candidate": {"hit_rate": 0.75, "repetitions": 4, "cold_hit_rate": 0.4,
                                            "layers": {"0": 0.7, "1": 0.8, "2": 0.75}}}
    no_cache = _test2("tg128 ncmoe0", 340.0, 340.0, 1.0, 0.99, 1.01)
    path = _schema2(tmp_path / "tg.json", [with_cache, no_cache], candidate_name="patched")
    from pyllama_moe.plot.hits import hit_rates_figure

    fig = hit_rates_figure([path])
    (ax,) = fig.axes
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [0, 1, 2] and list(line.get_ydata()) == [0.7, 0.8, 0.75]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["tg128 ncmoe48, patched (75.0%)"]
    proc = _cli(path, "--hit-rates", "-o", tmp_path / "hits.svg")
    assert proc.returncode == 0 and "hit rate per layer" in proc.stdout
    ET.parse(tmp_path / "hits.svg")
    # a file without hit rates says what to run
    bare = _schema2(tmp_path / "bare.json", [no_cache])
    proc = _cli(bare, "--hit-rates", "-o", tmp_path / "none.svg")
    assert proc.returncode == 2 and "has a cache hit rate" in proc.stderr and not (tmp_path / "none.svg").exists()


def test_hit_rates_add_a_panel_of_the_bytes_over_pcie_per_token_where_rows_say_it(tmp_path):
    rows = []
    for name, rate, per_token in (("tg128 mcm7800", 0.75, 3 * 2**20), ("tg128 mcm3900", 0.5, 6 * 2**20)):
        t = _test2(name, 31.0, 90.0, 2.9, 2.7, 3.1)
        t["hit_rate"] = {"candidate": {"hit_rate": rate, "repetitions": 4, "cold_hit_rate": None,
                                       "layers": {"0": rate, "1": rate}, "upload_bytes_per_token": per_token}}
        rows.append(t)
    path = _schema2(tmp_path / "tg.json", rows, candidate_name="patched")
    from pyllama_moe.plot.hits import hit_rates_figure

    fig = hit_rates_figure([path])
    rates, transfers = fig.axes
    assert len(rates.get_lines()) == 2
    assert [b.get_width() for b in transfers.patches] == [3.0, 6.0]  # MiB per token, a bar per row and side
    assert [t.get_text() for t in transfers.get_yticklabels()] == ["tg128 mcm7800, patched", "tg128 mcm3900, patched"]
    out = tmp_path / "hits.png"
    assert _cli(path, "--hit-rates", "-o", out).returncode == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hit_rates_read_a_patched_llama_bench_sweep_of_the_cache_budget(tmp_path):
    # llama-bench's own -o json of one build, -mcm 2000,8000: a row per budget, its warm repetitions (not the first)
    def record(mcm, rates, uploads):
        return {"n_prompt": 0, "n_gen": 64, "moe_cache_mib": mcm, "samples_ts": [90.0] * len(rates),
                "samples_moe_cache_hit_rate": rates, "samples_moe_cache_layer_hit_rates": [f"0={r},1={r}" for r in rates],
                "samples_moe_cache_upload_bytes": uploads}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps([record(2000, [0.1, 0.4, 0.5], [9 * 64 * 2**20, 4 * 64 * 2**20, 2 * 64 * 2**20]),
                                record(8000, [0.3, 0.8, 0.8], [5 * 64 * 2**20, 64 * 2**20, 64 * 2**20])]))
    from pyllama_moe.plot.hits import hit_series, hit_rates_figure

    series = hit_series(path)
    assert [(label, overall, per_token / 2**20) for label, _, overall, per_token in series] == [
        ("pp0 tg64 mcm2000", pytest.approx(0.45), pytest.approx(3.0)), ("pp0 tg64 mcm8000", pytest.approx(0.8), pytest.approx(1.0))]
    assert series[0][1] == [(0, pytest.approx(0.45)), (1, pytest.approx(0.45))]
    _, transfers = hit_rates_figure([path]).axes
    assert [b.get_width() for b in transfers.patches] == [pytest.approx(3.0), pytest.approx(1.0)]
