"""The native pieces `pyllama-moe bench` relies on, on the CPU builds: the copy probe (on SIM), the planted
slowdown knob, and the host bytes behind the PCIe bound. No timing is asserted: only that each piece runs,
reports what it measured in the agreed shape, and is read from the right tensors."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from gguf import GGUFReader

from pyllama_moe.bench import limits as bench_limits
from pyllama_moe.bench.hits import parse_layer_rates

pytestmark = pytest.mark.build


def _env_without_sim(**extra) -> dict:
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("GGML_SIM_", "LLAMA_MOE_DEBUG"))}, **extra}


def test_copy_probe_measures_the_simulated_device(patched_build):
    exe = patched_build.tool(bench_limits.PROBE)
    proc = subprocess.run([str(exe), "--mib", "8", "--reps", "3"], capture_output=True, text=True,
                          env=_env_without_sim(GGML_SIM_DEVICES="2"))
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [d["device"] for d in lines] == ["SIM0", "SIM1"]
    for d in lines:
        assert d["bytes"] == 8 << 20 and d["reps"] == 3
        assert 0 < d["pinned_min_gbps"] <= d["pinned_gbps"] <= d["pinned_max_gbps"]
        assert d["pageable_gbps"] > 0
    none = subprocess.run([str(exe)], capture_output=True, text=True, env=_env_without_sim())
    assert none.returncode == 1 and "no GPU device registered" in none.stderr and none.stdout == ""


def test_copy_probe_times_an_upload_queued_behind_another_on_a_second_queue(patched_build):
    exe = patched_build.tool(bench_limits.PROBE)
    proc = subprocess.run([str(exe), "--mib", "16", "--small", "2", "--reps", "3"], capture_output=True, text=True,
                          env=_env_without_sim(GGML_SIM_DEVICES="1"))
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["small_bytes"] == 2 << 20
    # each "behind" time and its "large" time share one start, and the large one is waited for second, so the
    # order of those two is fixed; small alone against small behind is a race between two timings (SIM runs each
    # backend's copies on its own worker, so the small one need not wait) and is not asserted
    assert d["small_alone_ms"] > 0
    assert 0 < d["small_behind_ms"] <= d["large_ms"]
    assert 0 < d["small_behind_pieces_ms"] <= d["large_pieces_ms"]
    for args, what in ((["--mib", "4", "--small", "8"], "larger than --mib"), (["--small", "0"], "--small needs")):
        bad = subprocess.run([str(exe), *args], capture_output=True, text=True,
                             env=_env_without_sim(GGML_SIM_DEVICES="1"))
        assert bad.returncode == 2 and what in bad.stderr and bad.stdout == "", (args, bad.stderr)


def test_bench_takes_the_probe_from_the_build_that_has_it(patched_build, master_build, monkeypatch):
    monkeypatch.setenv("GGML_SIM_DEVICES", "1")
    found = bench_limits.run_copy_probe({"baseline": master_build, "candidate": patched_build}, mib=8)
    assert found["device"] == "SIM0" and found["pinned_gbps"] > 0
    monkeypatch.delenv("GGML_SIM_DEVICES")
    assert bench_limits.run_copy_probe({"baseline": master_build, "candidate": master_build}) is None


def test_host_bytes_are_the_offloaded_matrices(tiny_model):
    reader = GGUFReader(tiny_model)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    n_layer = max(int(m.group(1)) for name in sizes if (m := re.match(r"blk\.(\d+)\.", name))) + 1

    def layer(name):
        m = re.match(r"blk\.(\d+)\.", name)
        return int(m.group(1)) if m else None

    experts_of_first_two = sum(n for name, n in sizes.items() if "_exps" in name and layer(name) < 2)
    assert experts_of_first_two > 0
    assert bench_limits.host_upload_bytes(tiny_model, n_cpu_moe=2, n_gpu_layers=99) == experts_of_first_two
    assert bench_limits.host_upload_bytes(tiny_model, n_cpu_moe=0, n_gpu_layers=99) == 0
    assert bench_limits.host_upload_bytes(tiny_model, n_cpu_moe=0, n_gpu_layers=-1) == 0  # llama-bench's default
    assert bench_limits.host_upload_bytes(tiny_model, n_cpu_moe=2, n_gpu_layers=-1) == experts_of_first_two
    # -ngl n_layer leaves layer 0 on the CPU (llama.cpp counts the output layer among the -ngl layers)
    dims = {t.name: len(t.shape) for t in reader.tensors}
    layer0 = sum(n for name, n in sizes.items() if layer(name) == 0 and dims[name] >= 2)
    assert bench_limits.host_upload_bytes(tiny_model, n_cpu_moe=0, n_gpu_layers=n_layer) == layer0


def test_planted_slowdown_knob_is_read_once_and_logged(patched_build, tiny_model):
    def bench(value):
        env = _env_without_sim() if value is None else _env_without_sim(LLAMA_MOE_DEBUG_SLOWDOWN_PCT=value)
        proc = subprocess.run([str(patched_build.tool("llama-bench")), "-m", str(tiny_model), "-p", "0", "-n", "2",
                               "-r", "1", "-t", "2", "-v"], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stderr

    planted = bench("5")
    assert planted.count("LLAMA_MOE_DEBUG_SLOWDOWN_PCT=5: every compute is made 5% slower") == 1
    assert "LLAMA_MOE_DEBUG_SLOWDOWN_PCT=5000 ignored" in bench("5000")
    assert "LLAMA_MOE_DEBUG_SLOWDOWN_PCT=0.05 ignored" in bench("0.05")
    assert "LLAMA_MOE_DEBUG_SLOWDOWN_PCT" not in bench(None)
    # without -v too: llama-bench silences llama.cpp's log, the knob must still say it is active
    quiet = subprocess.run([str(patched_build.tool("llama-bench")), "-m", str(tiny_model), "-p", "0", "-n", "2",
                            "-r", "1", "-t", "2"], capture_output=True, text=True,
                           env=_env_without_sim(LLAMA_MOE_DEBUG_SLOWDOWN_PCT="5"))
    assert quiet.returncode == 0 and "every compute is made 5% slower" in quiet.stderr


def test_llama_bench_reports_the_cache_hit_rate_per_layer_and_repetition(patched_build, tiny_model):
    # on one SIM device, every expert on the host: no cache, a small one (evicting) and a whole one (a slot per expert:
    # read in place once every expert is resident, all hits)
    def bench(*args):
        proc = subprocess.run([str(patched_build.tool("llama-bench")), "-m", str(tiny_model), "-p", "0", "-n", "16",
                               "-r", "3", "-t", "2", "-ngl", "99", "-ncmoe", "4", "-mcm", "0,2,16", *args],
                              capture_output=True, text=True, env=_env_without_sim(GGML_SIM_DEVICES="1"))
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    off, small, whole = json.loads(bench("-o", "json"))
    assert off["moe_cache_mib"] == 0 and off["moe_cache_hit_rate"] == -1 and off["moe_cache_layer_hit_rates"] == ""
    assert "samples_moe_cache_hit_rate" not in off
    for entry in (small, whole):
        reps = entry["samples_moe_cache_hit_rate"]
        layers = [parse_layer_rates(text) for text in entry["samples_moe_cache_layer_hit_rates"]]
        assert len(reps) == len(layers) == 3 and all(sorted(rates) == [0, 1, 2, 3] for rates in layers)
        # every repetition and layer looks up as many experts (16 tokens, top-k): the rates average exactly
        assert entry["moe_cache_hit_rate"] == pytest.approx(sum(reps) / 3, abs=1e-4)
        overall = parse_layer_rates(entry["moe_cache_layer_hit_rates"])
        assert entry["moe_cache_hit_rate"] == pytest.approx(sum(overall.values()) / 4, abs=1e-4)
        for il, rate in overall.items():
            assert rate == pytest.approx(sum(r[il] for r in layers) / 3, abs=1e-4)
    assert 0 < small["moe_cache_hit_rate"] < 1
    # the whole cache: misses only while it fills, then every step reads in place (all hits)
    assert whole["samples_moe_cache_hit_rate"][-1] == 1.0 and whole["moe_cache_hit_rate"] > small["moe_cache_hit_rate"]
    # markdown: a hit% column, '-' for the test without a cache
    rows = [line for line in bench("-o", "md").splitlines() if line.startswith("|")]
    col = [c.strip() for c in rows[0].split("|")].index("hit%")
    cells = [[c.strip() for c in row.split("|")][col] for row in rows[2:]]
    assert cells[0] == "-" and float(cells[1]) == pytest.approx(100 * small["moe_cache_hit_rate"], abs=0.1)


def test_llama_bench_runs_the_cache_probes_as_rows(patched_build, tiny_model):
    # a whole cache (16 MiB: a slot per expert) three ways in one run: as is (read in place once resident), probe 1
    # (15 of 16 slots a layer: looked up, a few misses) and probe 2 (never read in place: looked up, all hits once full)
    proc = subprocess.run([str(patched_build.tool("llama-bench")), "-m", str(tiny_model), "-p", "0", "-n", "16",
                           "-r", "2", "-t", "2", "-ngl", "99", "-ncmoe", "4", "-mcm", "16", "-mcp", "0,1,2", "-o", "json"],
                          capture_output=True, text=True, env=_env_without_sim(GGML_SIM_DEVICES="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain, below, lookup = json.loads(proc.stdout)
    assert [e["moe_cache_probe"] for e in (plain, below, lookup)] == [0, 1, 2]
    # filled whole when made: the plain and the lookup rows hit once full; n_expert - 1 slots start empty and miss
    assert plain["samples_moe_cache_hit_rate"][-1] == 1.0 and lookup["samples_moe_cache_hit_rate"][-1] == 1.0
    assert 0 < below["moe_cache_hit_rate"] < 1
    # out of range: one clear line, nothing run
    bad = subprocess.run([str(patched_build.tool("llama-bench")), "-m", str(tiny_model), "-mcp", "3"],
                         capture_output=True, text=True, env=_env_without_sim(GGML_SIM_DEVICES="1"))
    assert bad.returncode != 0 and "--moe-cache-probe 3: expected 0 (off)" in bad.stderr


def test_llama_bench_runs_the_cpu_worker_off_and_on_as_rows(patched_build, tiny_model):
    # -sac 0,1 on SIM with layers 0-1's experts on the host: the column sac, and the worker's rows as rows of one run;
    # the markdown table shows the column
    args = [str(patched_build.tool("llama-bench")), "-m", str(tiny_model), "-p", "0", "-n", "8", "-r", "2", "-t", "2",
            "-ngl", "99", "-ncmoe", "2", "-sac", "0,1"]
    sim = _env_without_sim(GGML_SIM_DEVICES="1")
    proc = subprocess.run([*args, "-o", "json"], capture_output=True, text=True, env=sim)
    assert proc.returncode == 0, proc.stderr[-2000:]
    off, on = json.loads(proc.stdout)
    assert (off["sched_async_cpu"], on["sched_async_cpu"]) == (0, 1) and off["avg_ts"] > 0 and on["avg_ts"] > 0
    md = subprocess.run([*args, "-o", "md"], capture_output=True, text=True, env=sim)
    header = [c.strip() for c in next(ln for ln in md.stdout.splitlines() if ln.startswith("|")).split("|")]
    assert "sac" in header
    # out of range: one clear line, nothing run
    bad = subprocess.run([str(patched_build.tool("llama-bench")), "-m", str(tiny_model), "-sac", "2"],
                         capture_output=True, text=True, env=_env_without_sim(GGML_SIM_DEVICES="1"))
    assert bad.returncode != 0 and "--sched-async-cpu 2: expected 0" in bad.stderr


def test_each_side_builds_from_the_archive_it_names(monkeypatch, tmp_path):
    # the series before a change against the one after: both "patched", each from its own `source pack` archive
    from pyllama_moe.build import builder as build_mod
    from pyllama_moe.cli.main import main

    before, after = tmp_path / "before.tar.gz", tmp_path / "after.tar.gz"
    before.write_bytes(b"x")
    after.write_bytes(b"y")
    seen = []

    class Stop(Exception):
        pass

    def fake_resolve(variant, backend, **kw):
        seen.append((variant, kw.get("archive")))
        if len(seen) == 2:
            raise Stop
        return None

    monkeypatch.setattr(build_mod, "resolve", fake_resolve)
    with pytest.raises(Stop):
        main(["bench", "--synth", "qwen3moe", "--baseline", "patched", "--candidate", "patched", "--baseline-archive",
              str(before), "--candidate-archive", str(after), "--archive-dir", str(tmp_path / "unused"), "--", "-n", "1"])
    assert seen == [("patched", before), ("patched", after)]
