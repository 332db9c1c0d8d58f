"""Host-weight uploads beside bench rows (pyllama_moe/bench/host_uploads.py), from llama-bench-shaped entries: the kept
repetitions' bytes per side, warm-up repetitions left out, rows whose build reported none left out; and the patched
llama-bench's own per-repetition fields from a SIM run, in both prompt orders."""
from __future__ import annotations

import json
import subprocess

import pytest

from pyllama_moe.bench import host_uploads as bench_host, rounds as bench
from pyllama_moe.harness import models
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR

from llama_tools import clean_env

NAMES = {"baseline": "ubatch order", "candidate": "layer-major"}
GIB = 2**30


def _entry(n_cpu_moe, ts, uploads=None, kept=None):
    entry = {"n_prompt": 4096, "n_gen": 0, "n_ubatch": 512, "n_batch": 4096, "n_gpu_layers": 99, "n_cpu_moe": n_cpu_moe,
             "load_mode": "none", "samples_ts": ts, "avg_ts": ts[0]}
    if uploads is not None:
        entry["samples_host_upload_bytes"] = uploads
        entry["samples_host_kept_bytes"] = kept
    return entry


def _result():
    result = bench.BenchResult()
    for rnd in range(2):
        # every expert on the host: ubatch order uploads them in each of 8 ubatches, layer-major once and keeps them
        # for the other 7; the first repetition of each process is discarded (and uploads more: it is not counted)
        bench._add_invocation(result, [_entry(48, [1700.0] * 3, [9 * GIB, 8 * GIB, 8 * GIB], [0, 0, 0]),
                                       _entry(0, [7000.0] * 3)], "baseline", rnd, 2 * rnd, 1)
        bench._add_invocation(result, [_entry(48, [5000.0] * 3, [2 * GIB, GIB, GIB], [7 * GIB] * 3),
                                       _entry(0, [7000.0] * 3)], "candidate", rnd, 2 * rnd + 1, 1)
    return result


def test_a_rows_uploads_are_its_kept_repetitions_and_rows_without_them_are_left_out():
    up = bench_host.host_uploads(_result())
    assert list(up) == ["pp4096 ub512 ngl99 ncmoe48 lm=none"]
    sides = up["pp4096 ub512 ngl99 ncmoe48 lm=none"]["host_uploads"]
    assert sides["baseline"] == {"upload_bytes": pytest.approx(8 * GIB), "kept_bytes": 0, "repetitions": 4}
    assert sides["candidate"] == {"upload_bytes": pytest.approx(GIB), "kept_bytes": pytest.approx(7 * GIB),
                                  "repetitions": 4}


def test_the_table_columns_and_the_json_carry_them():
    result = _result()
    up = bench_host.host_uploads(result)
    table = bench.format_table(result, NAMES, extra=bench_host.host_upload_columns(up, NAMES))
    head = next(line for line in table.splitlines() if line.startswith("| test"))
    assert "host GiB up, ubatch order" in head and "host GiB up, layer-major" in head
    row = next(line for line in table.splitlines() if "ncmoe48" in line)
    assert "| 8.00 |" in row and "| 1.00 (7.00 kept) |" in row
    samples = json.loads(bench.to_json(result, {}, None, up))["tests"][0]["samples"]
    assert {s["host_upload_bytes"] for s in samples if s["side"] == "candidate" and not s["discarded"]} == {GIB}


def test_the_patched_llama_bench_reports_each_repetitions_uploads(patched_build):
    # SIM with every expert on the host, a 160-token prompt at ub 32 (5 ubatches): ubatch order uploads the experts
    # in every ubatch, layer-major once per repetition, finding them kept for the other 4
    gguf = models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])
    out = subprocess.run([str(patched_build.tool("llama-bench")), "-m", str(gguf), "-p", "160", "-n", "0", "-b", "160",
                          "-ub", "32", "-r", "2", "-t", "2", "-ngl", "99", "-ncmoe", "99", "-lmp", "0,1", "-o", "json"],
                         capture_output=True, text=True, timeout=300,
                         env=clean_env(GGML_SIM_DEVICES="1", GGML_SCHED_PREFETCH="2", GGML_SCHED_PREFETCH_MIN_BATCH="32"))
    assert out.returncode == 0, out.stderr[-2000:]
    ubatch_order, layer_major = json.loads(out.stdout)
    per_ubatch = ubatch_order["samples_host_upload_bytes"][0] / 5
    assert per_ubatch > 0 and ubatch_order["samples_host_upload_bytes"] == [5 * per_ubatch] * 2
    assert ubatch_order["samples_host_kept_bytes"] == [0, 0]
    assert layer_major["samples_host_upload_bytes"] == [per_ubatch] * 2
    assert layer_major["samples_host_kept_bytes"] == [4 * per_ubatch] * 2
