"""Hit rates beside bench rows (pyllama_moe/bench/hits.py), from llama-bench-shaped entries: the kept repetitions' rates per side
and per layer, each process's first (cold) one apart, warm-up rounds in neither, and rows without a cache left out."""
from __future__ import annotations

import json

import pytest

from pyllama_moe.bench import hits as bench_hits, rounds as bench

NAMES = {"baseline": "master", "candidate": "patched"}


def _entry(n_cpu_moe, ts, hits=None, layers=None, uploads=None):
    entry = {"n_prompt": 0, "n_gen": 128, "n_ubatch": 512, "n_batch": 2048, "n_gpu_layers": 99, "n_cpu_moe": n_cpu_moe,
             "load_mode": "none", "samples_ts": ts, "avg_ts": ts[0]}
    if hits is not None:
        entry["samples_moe_cache_hit_rate"] = hits
        entry["samples_moe_cache_layer_hit_rates"] = layers
    if uploads is not None:
        entry["samples_moe_cache_upload_bytes"] = uploads
    return entry


MIB = 2**20


def _result():
    result = bench.BenchResult()
    # a warm-up round: every repetition discarded, the first one cold
    bench._add_invocation(result, [_entry(48, [50.0, 100.0, 100.0], [0.25, 0.9, 0.9], ["0=0.2500,1=0.2500",
                                   "0=0.9000,1=0.9000", "0=0.9000,1=0.9000"])], "candidate", -1, 0, 3)
    for rnd in range(2):
        # master has no cache (no hit rate fields); patched's first repetition of each process is cold and discarded
        bench._add_invocation(result, [_entry(48, [30.0, 31.0, 31.0]), _entry(0, [340.0] * 3)], "baseline", rnd, 2 * rnd, 1)
        bench._add_invocation(result, [
            # bytes uploaded by each repetition's 128 decode steps: 640, 128 and 256 MiB (the kept ones: 1.5 MiB a token)
            _entry(48, [60.0, 110.0, 112.0], [0.25, 0.70, 0.80], ["0=0.2000,1=0.3000", "0=0.6000,1=0.8000", "0=0.7000,1=0.9000"],
                   [640 * MIB, 128 * MIB, 256 * MIB]),
            _entry(0, [340.0] * 3, [-1.0, -1.0, -1.0], ["", "", ""]),  # a cache with nothing to cache: -1
        ], "candidate", rnd, 2 * rnd + 1, 1)
    return result


def test_a_rows_hit_rate_is_its_kept_repetitions_and_the_cold_ones_are_apart():
    hits = bench_hits.hit_rates(_result())
    assert list(hits) == ["tg128 ub512 ngl99 ncmoe48 lm=none"]  # master's rows and the -1 row have none
    h = hits["tg128 ub512 ngl99 ncmoe48 lm=none"]["hit_rate"]
    assert list(h) == ["candidate"]
    assert h["candidate"]["hit_rate"] == pytest.approx(0.75) and h["candidate"]["repetitions"] == 4
    assert h["candidate"]["cold_hit_rate"] == pytest.approx(0.25)  # rep 0 of 3 processes, the warm-up's warm reps not
    assert h["candidate"]["layers"] == {0: pytest.approx(0.65), 1: pytest.approx(0.85)}
    # the kept repetitions' bytes over PCIe per generated token: (128 + 256) / 2 MiB over 128 tokens
    assert h["candidate"]["upload_bytes_per_token"] == pytest.approx(1.5 * MIB)


def test_the_table_column_and_the_layer_lines_and_the_json_carry_them():
    result = _result()
    hits = bench_hits.hit_rates(result)
    table = bench.format_table(result, NAMES, extra=bench_hits.hit_columns(hits, NAMES))
    assert "| hit rate, patched |" in table.splitlines()[0]
    assert "75.0% (layers 65.0%-85.0%)" in table
    assert "| PCIe per token, patched |" in table.splitlines()[0] and "| 1.50 MiB |" in table
    lines = bench_hits.format_layer_hits(hits, NAMES)
    assert lines == ("hit rate per layer (%), tg128 ub512 ngl99 ncmoe48 lm=none, patched: 0:65 1:85; "
                     "cold (first repetitions) 25.0%")
    doc = json.loads(bench.to_json(result, {}, extra_rows=hits))
    row = next(t for t in doc["tests"] if t["key"]["n_cpu_moe"] == 48)
    assert row["hit_rate"]["candidate"]["layers"] == {"0": pytest.approx(0.65), "1": pytest.approx(0.85)}
    assert [s["hit_rate"] for s in row["samples"] if s["side"] == "candidate"][3:6] == [0.25, 0.70, 0.80]
    assert [s["upload_bytes"] for s in row["samples"] if s["side"] == "candidate"][3:6] == [640 * MIB, 128 * MIB, 256 * MIB]
    assert row["hit_rate"]["candidate"]["upload_bytes_per_token"] == pytest.approx(1.5 * MIB)


def test_a_build_that_reports_no_upload_bytes_has_no_pcie_column():
    # an older patched llama-bench: hit rates but no samples_moe_cache_upload_bytes
    result = bench.BenchResult()
    bench._add_invocation(result, [_entry(48, [100.0] * 3, [0.5] * 3, ["0=0.5000"] * 3)], "candidate", 0, 0, 1)
    hits = bench_hits.hit_rates(result)
    assert next(iter(hits.values()))["hit_rate"]["candidate"]["upload_bytes_per_token"] is None
    assert "PCIe per token" not in bench.format_table(result, NAMES, extra=bench_hits.hit_columns(hits, NAMES))


def test_layer_rates_parse():
    assert bench_hits.parse_layer_rates("0=0.7500,13=1.0000") == {0: 0.75, 13: 1.0}
    assert bench_hits.parse_layer_rates("") == {} and bench_hits.parse_layer_rates(None) == {}


def test_a_decode_rows_cache_bound_is_its_limit_plus_its_misses_bytes_at_the_link_rate():
    from pyllama_moe.bench import limits as bench_limits

    result = _result()
    hits = bench_hits.hit_rates(result)
    limits = bench_limits.limit_shares(result, "n_cpu_moe", "0")
    label = "tg128 ub512 ngl99 ncmoe48 lm=none"
    assert bench_limits.cache_bound(result, limits, hits, []) == {}  # no probe, no bound
    bound = bench_limits.cache_bound(result, limits, hits, [{"pinned_gbps": 50.0}, {"pinned_gbps": 60.0}])
    assert list(bound) == [label]  # the limit row itself and master's rows have no cache
    b = bound[label]
    # the limit (340 t/s) plus 1.5 MiB a token at 55 GB/s
    want_ts = 1 / (1 / 340.0 + 1.5 * MIB / 55e9)
    assert b["cache_bound_ts"] == pytest.approx(want_ts) and b["cache_bound_gbps"] == pytest.approx(55.0)
    share = limits[label]["limit"]["share_candidate"]
    assert b["cache_bound_share"] == pytest.approx(share * 340.0 / want_ts)
    assert b["cache_bound_share_low"] <= b["cache_bound_share"] <= b["cache_bound_share_high"]
    # the kept repetitions ran at 110-112 t/s against a bound of ~337: a third of it
    assert 0.32 < b["cache_bound_share"] < 0.34
    cells = bench_limits.limit_columns(limits, {}, NAMES, bound)[label]
    assert cells["cache bound t/s"] == f"{want_ts:.0f}" and cells["share of cache bound"].startswith(
        f"{b['cache_bound_share']:.3f} [")
