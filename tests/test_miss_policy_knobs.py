"""The expert cache's miss policy as a user sets it (docs/hot-cold.md): llama.cpp's --moe-miss-policy and
LLAMA_ARG_MOE_MISS_POLICY, llama-bench's -mmp dimension and its cold-miss counts, `pyllama-moe run --moe-miss-policy`,
`pyllama-moe bench`'s check of -mmp, and moe_llama's moe_miss_policy=. Each spelling must reach libllama, and each
bad one be refused in one line. What a policy computes is the hot/cold tests' business, not this file's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llama_tools import clean_env, cli_refusal, completion
from pyllama_moe.arguments import MISS_CPU, MISS_SPLIT, MISS_UPLOAD, parse_miss_policy

SIM = {"GGML_SIM_DEVICES": "1"}
PROMPT = " ".join(f"w{(k * 37) % 97}" for k in range(40))
REFUSED = "expected upload, cpu or split:N (N 1..4096)"  # the C tools' line


# ---- the spelling, without a build -----------------------------------------------------------------------------

@pytest.mark.parametrize("text, want", [
    ("upload", (MISS_UPLOAD, 0)), ("cpu", (MISS_CPU, 0)), ("split:1", (MISS_SPLIT, 1)),
    ("split:4096", (MISS_SPLIT, 4096)), ("split:08", (MISS_SPLIT, 8)),
    ("split:0", None), ("split:4097", None), ("split:", None), ("split:-1", None), ("split:1x", None),
    ("split:1234567", None), ("Upload", None), ("", None), (" cpu", None), (4, None), (None, None),
])
def test_the_policy_is_parsed_as_the_build_parses_it(text, want):
    # llama_moe_parse_miss_policy's rules: the two words, or split: and 1 to 6 digits whose value is 1..4096
    assert parse_miss_policy(text) == want


@pytest.mark.parametrize("bad", ["split:0", "gpu", 2])
def test_moe_llama_refuses_a_policy_it_cannot_parse_before_loading_anything(bad):
    from pyllama_moe import llm

    # no use_build, no llama_cpp: the value is refused first
    with pytest.raises(ValueError, match=r"moe_miss_policy=.* is not a miss policy: give upload, cpu or split:N"):
        llm.moe_llama("no-such.gguf", moe_miss_policy=bad)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
    from pyllama_moe.synth.shapes import resolve_shape
    from pyllama_moe.synth.writer import write_model

    model = tmp_path_factory.mktemp("miss-policy") / "tiny.gguf"
    write_model(model, resolve_shape("tiny"), progress=False)
    return model


@pytest.mark.parametrize("argv, flag", [
    (["run", "{model}", "--moe-miss-policy", "split:0"], "argument --moe-miss-policy: 'split:0' is not a miss policy"),
    (["run", "{model}", "--moe-miss-policy", "gpu"], "argument --moe-miss-policy: 'gpu' is not a miss policy"),
    (["run", "{model}", "--moe-miss-policy", "cpu", "--variant", "master"], "--moe-miss-policy needs the patched build"),
    (["bench", "--model", "{model}", "--", "-mmp", "upload,split:0"], "argument -mmp (llama-bench): 'split:0' in"),
    (["bench", "--model", "{model}", "--", "--moe-miss-policy", "split:5000"], "'split:5000' is not a miss policy"),
    # two values would share a row of the A/B table, which pairs rows by the fields master reports too
    (["bench", "--model", "{model}", "--", "-mmp", "upload,cpu"], "llama-bench -mmp upload,cpu: bench pairs rows"),
])
def test_the_cli_refuses_a_bad_policy_in_one_line_before_any_work(tiny_file, tmp_path, argv, flag):
    stderr = cli_refusal(argv, tiny_file, tmp_path / "home")
    assert stderr.startswith(f"pyllama-moe {argv[0]}: error: ") and flag in stderr, stderr


def test_run_hands_the_policy_to_the_worker_and_prints_the_cold_misses(tiny_file, monkeypatch, capsys):
    import numpy as np

    from pyllama_moe.build import builder as build
    from pyllama_moe.cli import harness as cli_harness, main as cli
    from pyllama_moe.harness import runner

    specs = []
    decode = {"n_ubatches": 40, "n_hits": 90, "n_misses": 0, "n_routed_in_place": 0, "n_cold": 30}
    result = runner.RunResult(np.zeros((2, 4), np.float32), "ab" * 32, [1], "x", "log",
                              stats={"generate": {"cache_decode": decode}})
    monkeypatch.setattr(cli_harness, "_source", lambda args: None)
    monkeypatch.setattr(build, "resolve", lambda *a, **kw: build.Build(Path("/b"), "k", "patched", "cpu"))
    monkeypatch.setattr(runner, "run", lambda built, src, spec: specs.append(spec) or result)
    monkeypatch.setenv("GGML_SIM_DEVICES", "1")
    assert cli.main(["run", str(tiny_file), "-mcm", "2", "--moe-miss-policy", "split:4"]) == 0
    assert specs[0].env["LLAMA_MOE_MISS_POLICY"] == "split:4"
    # the cold misses count as misses in the hit rate: 90 of 120
    assert "hit rate 75.0%, 0 misses uploaded, 30 computed on the CPU" in capsys.readouterr().out
    assert cli.main(["run", str(tiny_file)]) == 0
    assert "LLAMA_MOE_MISS_POLICY" not in specs[1].env  # not given: the process's own


# ---- through the patched build, on SIM ---------------------------------------------------------------------------

def _complete(build, model, *args: str, **env: str) -> subprocess.CompletedProcess:
    return completion(build, model, PROMPT, "-ncmoe", "4", "--moe-cache-mib", "2", "-n", "8", *args, env={**SIM, **env})


@pytest.mark.build
def test_the_flag_and_its_environment_variable_set_the_policy_and_bad_ones_are_refused(patched_build, tiny_model):
    plain = _complete(patched_build, tiny_model)
    flag = _complete(patched_build, tiny_model, "--moe-miss-policy", "split:3")
    env = _complete(patched_build, tiny_model, LLAMA_ARG_MOE_MISS_POLICY="cpu")
    for proc in (plain, flag, env):
        assert proc.returncode == 0, proc.stderr[-3000:]
    # the cache says the policy it follows (or could not follow) when it is made
    assert "miss policy upload" in plain.stderr or "miss policy" not in plain.stderr
    assert "miss policy split:3" in flag.stderr and "miss policy cpu" in env.stderr
    for bad in (_complete(patched_build, tiny_model, "--moe-miss-policy", "split:0"),
                _complete(patched_build, tiny_model, LLAMA_ARG_MOE_MISS_POLICY="gpu")):
        assert bad.returncode != 0 and REFUSED in bad.stderr and bad.stdout == ""
    assert "LLAMA_ARG_MOE_MISS_POLICY" in bad.stderr  # the environment's refusal names the variable


def _bench(build, model, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(build.tool("llama-bench")), "-m", str(model), "-p", "0", "-n", "8", "-r", "2", "-t", "2",
                           "-ngl", "99", "-ncmoe", "4", "-mcm", "2", *args],
                          capture_output=True, text=True, timeout=300, env=clean_env(**SIM))


@pytest.mark.build
def test_llama_bench_runs_the_policies_as_rows_with_their_cold_misses(patched_build, tiny_model):
    proc = _bench(patched_build, tiny_model, "-mmp", "upload,cpu,split:1", "-o", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    upload, cpu, split = json.loads(proc.stdout)
    assert [e["moe_miss_policy"] for e in (upload, cpu, split)] == ["upload", "cpu", "split:1"]
    for entry in (upload, cpu, split):
        cold = entry["samples_moe_cache_cold_misses"]
        layers = dict(pair.split("=") for pair in entry["moe_cache_layer_cold_misses"].split(","))
        assert len(cold) == 2 and sorted(layers) == ["0", "1", "2", "3"]
        assert sum(int(n) for n in layers.values()) == sum(cold)
    # one token a step routes top-k experts, which the slots hold: uploading every miss leaves nothing cold
    assert sum(upload["samples_moe_cache_cold_misses"]) == 0 and 0 < upload["moe_cache_hit_rate"] < 1
    # no prompt (-p 0) and no uploads: nothing is ever resident, so every routed expert of the 8 one-token steps (top-4,
    # 4 layers) is a cold miss, and counts as one in the hit rate (which would otherwise have no lookups)
    assert cpu["samples_moe_cache_cold_misses"] == [8 * 4 * 4] * 2 and cpu["samples_moe_cache_upload_bytes"] == [0, 0]
    assert cpu["moe_cache_hit_rate"] == 0
    assert sum(split["samples_moe_cache_cold_misses"]) > 0 and min(split["samples_moe_cache_upload_bytes"]) > 0
    md = _bench(patched_build, tiny_model, "-mmp", "upload,cpu", "-o", "md")
    assert md.returncode == 0, md.stderr[-2000:]
    rows = [[c.strip() for c in ln.split("|")] for ln in md.stdout.splitlines() if ln.startswith("|")]
    col = rows[0].index("mmp")
    assert [row[col] for row in rows[2:]] == ["upload", "cpu"]
    # the default alone: no column
    plain = _bench(patched_build, tiny_model, "-o", "md")
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert "mmp" not in [c.strip() for c in next(ln for ln in plain.stdout.splitlines() if ln.startswith("|")).split("|")]
    # a bad element: its line, then llama-bench's own refusal and usage; no test run
    bad = _bench(patched_build, tiny_model, "-mmp", "upload,split:0")
    assert bad.returncode != 0 and f"error: --moe-miss-policy split:0: {REFUSED}" in bad.stderr
    assert "tg8" not in bad.stdout


POLICY_SCRIPT = """
import json, sys
from pyllama_moe import llm

moe = llm.use_build("patched", "cpu")
model = llm.moe_llama(sys.argv[1], n_gpu_layers=99, cpu_moe=True, moe_cache_mib=2, moe_miss_policy="split:2",
                      n_ctx=256, n_threads=2, verbose=False)
model("the", max_tokens=8, temperature=0.0)
n = moe._ffi.new("int32_t *")
kind = moe.llama_moe_get_moe_miss_policy(llm._context_of(moe, model), n)
print(json.dumps({"context": [kind, n[0]], "default_after": llm._default_miss_policy(moe),
                  "decode": llm.cache_stats(moe, model)["decode"]}))
"""


@pytest.mark.build
def test_moe_llama_sets_the_policy_of_its_context_and_reports_the_cold_misses(patched_build, tiny_model):
    proc = subprocess.run([sys.executable, "-c", POLICY_SCRIPT, str(tiny_model)], capture_output=True, text=True,
                          env=clean_env(**SIM), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["context"] == [MISS_SPLIT, 2]
    assert got["default_after"] == [MISS_UPLOAD, 0]  # the process default is back to what it was
    decode = got["decode"]
    assert "n_cold" in decode and all("n_cold" in layer for layer in decode["layers"].values())
    assert decode["n_cold"] == sum(layer["n_cold"] for layer in decode["layers"].values())
