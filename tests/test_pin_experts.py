"""Pinned host experts on the SIM device.

A model loaded with mmap and its experts on the host registers the mapped expert range with the GPU
(SIM implements the same ggml_backend_host_map proc as CUDA and logs each call); when registration fails
(GGML_SIM_HOST_MAP_FAIL=1) the experts are copied into the device's pinned host buffer type; when that does
not fit they stay pageable. Each path must say so once in the log and compute the bytes of the run with
pinning off. Poison is on, so a copy that reached the pinned buffer before its NaN fill, or not at all,
would show in the logits. Only SIM is exercised here: CUDA's cudaHostRegister path runs on the GPU machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from pyllama_moe.build import ffi
from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR
from pyllama_moe.synth.gguf_read import read_gguf

SIM_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "GGML_SIM_COPY_LATENCY_US": "50"}
REGISTERED = "expert weights registered with SIM0"
COPIED = "expert weights copied into pinned memory (SIM_Host): registration with SIM0 failed"
PAGEABLE = "expert weights left pageable: registration with SIM0 failed and a pinned copy needs"
OFF = "expert weights left pageable: pinning is off"
# llama.cpp's own advice for CPU overrides with mmap: only with pinning off, where it is still true
MMAP_ADVICE = "consider using --load-mode none"


@pytest.fixture(scope="module")
def model():
    return models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])


# 96 tokens: one ubatch of at least 32, so MUL_MAT_ID is offloaded and the experts are uploaded from the host
TOKENS = [(i * 7919) % 4000 + 16 for i in range(96)]


def _run(build, src, model, env):
    spec = runner.RunSpec(model=model, tokens=TOKENS, cpu_moe=True, load_mode="mmap", repack=False, threads=2,
                          generate=4, env={**SIM_ENV, **env})
    return runner.run(build, src, spec)


def _ops(path, kinds=("host_map", "host_unmap")):
    if not path.exists():
        return []
    ops = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted((op for op in ops if op["op"] in kinds), key=lambda op: op["seq"])


@pytest.fixture(scope="module")
def pin_off(patched_build, src, model, tmp_path_factory):
    log = tmp_path_factory.mktemp("pin-off") / "ops.jsonl"
    got = _run(patched_build, src, model, {"LLAMA_MOE_PIN_EXPERTS": "0", "GGML_SIM_OPLOG": str(log)})
    assert got.log.count(OFF) == 1 and got.log.count(MMAP_ADVICE) == 1, got.log[-3000:]
    assert _ops(log) == []
    return got


def test_mapped_experts_are_registered_and_compute_the_same(patched_build, src, model, pin_off, tmp_path):
    log = tmp_path / "ops.jsonl"
    got = _run(patched_build, src, model, {"GGML_SIM_OPLOG": str(log)})
    assert got.log.count("llama_moe: ") == 1 and REGISTERED in got.log, got.log[-3000:]
    assert MMAP_ADVICE not in got.log
    assert got.logits_sha256 == pin_off.logits_sha256 and got.generated == pin_off.generated
    ops = _ops(log)
    assert ops and all(op["ok"] for op in ops)
    # per range: the model's reference (a register, refs 0 -> 1), the context's (1 -> 2), released in the
    # reverse order when the worker frees the context and then the model (the last one unregisters)
    by_ptr: dict[str, list[tuple[str, int]]] = {}
    for op in ops:
        by_ptr.setdefault(op["ptr"], []).append((op["op"], op["refs"]))
    for seq in by_ptr.values():
        assert seq == [("host_map", 1), ("host_map", 2), ("host_unmap", 1), ("host_unmap", 0)], seq


def test_failed_registration_copies_experts_to_pinned_memory(patched_build, src, model, pin_off, tmp_path):
    log = tmp_path / "ops.jsonl"
    got = _run(patched_build, src, model, {"GGML_SIM_HOST_MAP_FAIL": "1", "GGML_SIM_OPLOG": str(log)})
    assert got.log.count("llama_moe: ") == 1 and COPIED in got.log, got.log[-3000:]
    assert got.logits_sha256 == pin_off.logits_sha256 and got.generated == pin_off.generated
    ops = _ops(log)
    assert [op["op"] for op in ops] == ["host_map"] and not ops[0]["ok"]  # one attempt, nothing to unmap
    # the copy went through the pinned buffer's set_tensor, one per expert tensor (3 per layer, 4 layers)
    sets = [op for op in _ops(log, ("set",)) if "_exps" in op["tensor"] and op["dev"] == "SIM_Host"]
    assert len(sets) == 3 * 4


def test_no_room_for_a_copy_leaves_experts_pageable(patched_build, src, model, pin_off):
    # a budget that takes two layers' ranges in place but not a copy of all the experts: registration fails,
    # the copy must be refused, and the reason logged
    got = _run(patched_build, src, model, {"GGML_SIM_HOST_MAP_FAIL": "1", "LLAMA_MOE_PIN_BUDGET_MIB": "4"})
    assert got.log.count("llama_moe: ") == 1 and PAGEABLE in got.log, got.log[-3000:]
    assert "and a budget of 4.00 MiB" in got.log
    assert got.logits_sha256 == pin_off.logits_sha256 and got.generated == pin_off.generated


# experts larger than the memory a process may lock
PARTIAL = "of expert ranges registered with SIM0 (page-locked in place: "
NONE_FITS = "expert weights left pageable: not one range of them fits the"


def _registered_bytes(log):
    """Bytes the model registered (its own reference: refs 0 -> 1), checking every range is unregistered."""
    ops = _ops(log)
    assert ops and all(op["ok"] for op in ops)
    assert sorted(op["ptr"] for op in ops if op["op"] == "host_map") == sorted(op["ptr"] for op in ops if op["op"] == "host_unmap")
    return sum(op["bytes"] for op in ops if op["op"] == "host_map" and op["refs"] == 1)


@pytest.mark.parametrize("budget_mib", ["4", "2"])
def test_a_budget_below_the_experts_pins_part_of_them(patched_build, src, model, pin_off, tmp_path, budget_mib):
    log = tmp_path / "ops.jsonl"
    got = _run(patched_build, src, model, {"LLAMA_MOE_PIN_BUDGET_MIB": budget_mib, "GGML_SIM_OPLOG": str(log)})
    assert got.log.count("llama_moe: ") == 1 and PARTIAL in got.log, got.log[-3000:]
    assert f"{float(budget_mib):.2f} MiB of page-locked memory fit, the budget of LLAMA_MOE_PIN_BUDGET_MIB" in got.log
    assert 0 < _registered_bytes(log) <= int(budget_mib) << 20  # whole pieces that fit, no more
    assert got.logits_sha256 == pin_off.logits_sha256 and got.generated == pin_off.generated


@pytest.mark.parametrize("env, why", [
    ({"LLAMA_MOE_PIN_BUDGET_MIB": "0"}, "the 0.00 MiB of page-locked memory allowed, the budget of"),
    # a margin larger than any machine: no memory may be locked at all
    ({"LLAMA_MOE_PIN_MARGIN_MIB": "1e12"}, "the 0.00 MiB of page-locked memory allowed, "),
])
def test_no_budget_pins_nothing(patched_build, src, model, pin_off, tmp_path, env, why):
    log = tmp_path / "ops.jsonl"
    got = _run(patched_build, src, model, {**env, "GGML_SIM_OPLOG": str(log)})
    assert got.log.count("llama_moe: ") == 1 and NONE_FITS in got.log and why in got.log, got.log[-3000:]
    assert _ops(log) == []
    assert got.logits_sha256 == pin_off.logits_sha256 and got.generated == pin_off.generated


def test_memory_available_below_the_experts_pins_part(patched_build, model, tmp_path):
    # 2 GiB + 4 MiB available of 16 GiB: the margin (2 GiB) leaves 4 MiB, less than the experts' 7 MiB of ranges
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text("MemTotal:       16777216 kB\nMemAvailable:   2101248 kB\n")
    (tmp_path / "proc" / "self" / "cgroup").write_text("")
    tool = patched_build.tool("llama-completion")
    env = {**os.environ, **SIM_ENV, "LLAMA_MOE_PIN_FS_ROOT": str(tmp_path)}
    proc = subprocess.run([str(tool), "-m", str(model), "-ngl", "99", "-cmoe", "--no-repack", "--fit", "off", "-p", "hi",
                           "-n", "1", "-no-cnv", "--temp", "0"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert PARTIAL in proc.stderr, proc.stderr[-3000:]
    assert "4.00 MiB of page-locked memory fit, 2.00 GiB available less a 2.00 GiB margin" in proc.stderr


def test_ggml_cuda_no_pinned_turns_pinning_off(patched_build, src, model, pin_off, tmp_path):
    log = tmp_path / "ops.jsonl"
    got = _run(patched_build, src, model, {"GGML_CUDA_NO_PINNED": "1", "GGML_SIM_OPLOG": str(log)})
    assert "expert weights left pageable: pinning is off (GGML_CUDA_NO_PINNED is set)" in got.log, got.log[-3000:]
    assert _ops(log) == []


def test_pin_budget_flag_and_setter(patched_build, model, monkeypatch):
    # the flag reaches the process default; with the setter unset, the environment is read
    tool = patched_build.tool("llama-completion")
    env = {**os.environ, **SIM_ENV, "LLAMA_MOE_PIN_BUDGET_MIB": "100000"}
    proc = subprocess.run([str(tool), "-m", str(model), "-ngl", "99", "-cmoe", "--no-repack", "--fit", "off", "-p", "hi",
                           "-n", "1", "-no-cnv", "--temp", "0", "--pin-budget", "2"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and PARTIAL in proc.stderr and "2.00 MiB of page-locked memory fit" in proc.stderr, \
        proc.stderr[-3000:]
    # cffi: the setter beats the environment, which is read at each call while the setter is unset
    monkeypatch.setenv("LLAMA_MOE_PIN_BUDGET_MIB", "7")
    lib = ffi.load(patched_build)
    try:
        assert lib.llama_moe_default_get_pin_budget_mib() == 7
        lib.llama_moe_default_set_pin_budget_mib(3)
        assert lib.llama_moe_default_get_pin_budget_mib() == 3
    finally:
        lib.llama_moe_default_set_pin_budget_mib(-1)
    assert lib.llama_moe_default_get_pin_budget_mib() == 7
    monkeypatch.delenv("LLAMA_MOE_PIN_BUDGET_MIB")
    assert lib.llama_moe_default_get_pin_budget_mib() == -1


GIB = 1 << 30
# a container limit set on an ancestor of the process's cgroup (8 GiB, 7 used of which 0.5 inactive page cache;
# v1: 4 GiB, 3 used, 0.5 inactive), with no limit on its own cgroup: 1.5 GiB of room, below the 2 GiB margin
CGROUPS = {
    "v2": {"proc/self/cgroup": "0::/a/b\n", "sys/fs/cgroup/cgroup.controllers": "memory\n",
           "sys/fs/cgroup/a/b/memory.max": "max\n", "sys/fs/cgroup/a/b/memory.current": f"{GIB}\n",
           "sys/fs/cgroup/a/memory.max": f"{8 * GIB}\n", "sys/fs/cgroup/a/memory.current": f"{7 * GIB}\n",
           "sys/fs/cgroup/a/memory.stat": f"anon 1\ninactive_file {GIB // 2}\nactive_file 5\n"},
    "v1": {"proc/self/cgroup": "5:cpu,cpuacct:/\n4:memory:/x/y\n0::/\n",
           "sys/fs/cgroup/memory/x/y/memory.limit_in_bytes": "9223372036854771712\n",
           "sys/fs/cgroup/memory/x/y/memory.usage_in_bytes": f"{GIB}\n",
           "sys/fs/cgroup/memory/x/memory.limit_in_bytes": f"{4 * GIB}\n",
           "sys/fs/cgroup/memory/x/memory.usage_in_bytes": f"{3 * GIB}\n",
           "sys/fs/cgroup/memory/x/memory.stat": f"cache 1\ntotal_inactive_file {GIB // 2}\n"},
}


@pytest.mark.parametrize("version", sorted(CGROUPS))
def test_cgroup_limit_up_the_hierarchy_caps_the_pinned_memory(patched_build, model, tmp_path, version):
    files = {"proc/meminfo": "MemTotal:       67108864 kB\nMemFree:        1 kB\nMemAvailable:   62914560 kB\n",
             **CGROUPS[version]}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    tool = patched_build.tool("llama-completion")
    env = {**os.environ, **SIM_ENV, "GGML_SIM_HOST_MAP_FAIL": "1", "LLAMA_MOE_PIN_FS_ROOT": str(tmp_path)}
    proc = subprocess.run([str(tool), "-m", str(model), "-ngl", "99", "-cmoe", "--no-repack", "--fit", "off", "-p", "hi",
                           "-n", "1", "-no-cnv", "--temp", "0"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 60 GiB MemAvailable, capped by the ancestor's room; the margin is 2 GiB since 1/16 of the limit is less
    # (no memory may be locked at all, so not even registration in place is tried)
    assert NONE_FITS in proc.stderr and "1.50 GiB available less a 2.00 GiB margin" in proc.stderr, proc.stderr[-3000:]


# two contexts on one model, in one process, through llama_cpp; the setter must beat the environment
_TWO_CONTEXTS = textwrap.dedent("""
    import ctypes, os, sys
    from pathlib import Path
    lib_dir = Path(os.environ["LLAMA_CPP_LIB_PATH"])
    lib = ctypes.CDLL(str(lib_dir / "libllama.so"), mode=ctypes.RTLD_GLOBAL)
    import llama_cpp as L
    from pyllama_moe.worker.model import cpu_overrides
    assert lib.llama_moe_default_get_pin_experts() == 0           # LLAMA_MOE_PIN_EXPERTS=0
    lib.llama_moe_default_set_pin_experts(1)
    assert lib.llama_moe_default_get_pin_experts() == 1           # setter > environment
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 99
    overrides, _keep = cpu_overrides({"cpu_moe": True}, lib_dir)
    mp.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
    model = L.llama_model_load_from_file(sys.argv[1].encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx = 256
    ctxs = [L.llama_init_from_model(model, cp) for _ in range(2)]
    assert all(ctxs)
    for ctx in ctxs:
        L.llama_free(ctx)
    L.llama_model_free(model)
    lib.llama_moe_default_set_pin_experts(-1)
    assert lib.llama_moe_default_get_pin_experts() == 0           # unset: the environment again
    print("ok")
""")


def test_two_contexts_share_one_registration(patched_build, src, model, tmp_path):
    log = tmp_path / "ops.jsonl"
    env = runner.worker_env(patched_build, src, {**SIM_ENV, "GGML_SIM_OPLOG": str(log), "LLAMA_MOE_PIN_EXPERTS": "0"})
    proc = subprocess.run([sys.executable, "-c", _TWO_CONTEXTS, str(model)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.count(REGISTERED) == 1
    ops = _ops(log)
    assert ops and all(op["ok"] for op in ops)
    for ptr in {op["ptr"] for op in ops}:
        seq = [(op["op"], op["refs"]) for op in ops if op["ptr"] == ptr]
        # model, context 1, context 2 map; the contexts then the model unmap: one register, one unregister
        assert seq == [("host_map", 1), ("host_map", 2), ("host_map", 3),
                       ("host_unmap", 2), ("host_unmap", 1), ("host_unmap", 0)], seq


def test_no_pin_experts_flag_turns_it_off(patched_build, model):
    tool = patched_build.tool("llama-completion")
    base = [str(tool), "-m", str(model), "-ngl", "99", "-cmoe", "--no-repack", "--fit", "off", "-p", "hello",
            "-n", "1", "-no-cnv", "--temp", "0", "-v"]  # -v: the tools print llama's info lines only then
    env = {**os.environ, **SIM_ENV}
    off = subprocess.run(base + ["--no-pin-experts"], env=env, capture_output=True, text=True, timeout=600)
    assert off.returncode == 0 and OFF in off.stderr, off.stderr[-3000:]
    on = subprocess.run(base, env={**env, "LLAMA_MOE_PIN_EXPERTS": "0", "LLAMA_ARG_PIN_EXPERTS": "1"},
                        capture_output=True, text=True, timeout=600)
    assert on.returncode == 0 and REGISTERED in on.stderr, on.stderr[-3000:]


# split GGUF files. llama.cpp keeps one mapping per shard and unmaps each shard's head
# (metadata) and tail (weights of GPU layers); shards mapped one below the other are a few pages apart, so a
# range merged across two of them spans a hole, which cudaHostRegister (and SIM) refuse.
SPLIT = "qwen3moe-split"
REFUSED = "ggml_sim: host_map refuses"
MAX_GAP = 16 << 20  # the gap the pin code locks along inside one mapping
SPLIT_KEPT = "of expert weights pinned: "


@pytest.fixture(scope="module")
def split_model(master_build):
    matrix = load_matrix(CI_DIR / "matrix.toml")
    # the same model as the single file: only the split differs, so the two must compute the same bytes
    assert {k: v for k, v in matrix.models[SPLIT].items() if k != "split"} == matrix.models["qwen3moe"]
    return models.ensure_model(SPLIT, matrix.models[SPLIT], master_build)


def _pin_lines(text):
    """What a failed assertion shows: the pin code's line and SIM's refusals, not the whole log."""
    return "\n".join(line for line in text.splitlines() if "llama_moe: " in line or REFUSED in line)


def _pinned_expert_mib(text, what="registered with SIM0"):
    m = re.search(r"llama_moe: ([0-9.]+) MiB of expert weights " + re.escape(what), text)
    assert m, text[-3000:]
    return float(m.group(1))


def _model_ranges(log):
    """[(ptr, bytes)] the model registered (refs 0 -> 1), by address."""
    return sorted((int(op["ptr"], 16) if isinstance(op["ptr"], str) else op["ptr"], op["bytes"])
                  for op in _ops(log) if op["op"] == "host_map" and op["ok"] and op["refs"] == 1)


def test_the_split_model_has_three_shards(split_model):
    shards = sorted(split_model.parent.glob("*.gguf"))
    assert [s.name for s in shards] == [models.shard_name(SPLIT, i, 3) for i in (1, 2, 3)]
    infos = [read_gguf(s) for s in shards]
    assert all(info.kv["split.count"] == 3 for info in infos)
    # every shard holds experts, so each is a mapping of its own with a range of its own
    assert all(any("_exps" in name for name in info.tensors) for info in infos)


def test_sim_refuses_a_range_that_is_not_wholly_mapped(patched_build, tmp_path):
    # three pages with the middle one unmapped: the whole range is refused, each mapped page alone is not
    log = tmp_path / "ops.jsonl"
    code = textwrap.dedent("""
        import ctypes, mmap, sys
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        ggml = ctypes.CDLL(sys.argv[1])
        ggml.ggml_backend_reg_by_name.restype = ctypes.c_void_p
        ggml.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
        ggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
        ggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        reg = ggml.ggml_backend_reg_by_name(b"SIM")
        host_map = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_size_t)(
            ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_host_map"))
        host_unmap = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_host_unmap"))
        page = mmap.PAGESIZE
        base = libc.mmap(None, 3 * page, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        assert base not in (None, ctypes.c_void_p(-1).value)
        assert libc.munmap(base + page, page) == 0
        whole = host_map(base, 3 * page)
        first, last = host_map(base, page), host_map(base + 2 * page, page)
        host_unmap(base)
        host_unmap(base + 2 * page)
        print(whole, first, last, hex(base + page))
    """)
    env = {**os.environ, "GGML_SIM_DEVICES": "1", "GGML_SIM_OPLOG": str(log)}
    proc = subprocess.run([sys.executable, "-c", code, str(patched_build.bin_dir / "libggml.so")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *got, hole = proc.stdout.split()
    assert got == ["False", "True", "True"], proc.stdout + proc.stderr[-2000:]
    # the refusal names the unmapped page itself
    assert proc.stderr.count(REFUSED) == 1 and f"the page at {hole} (+0.00 MiB) is not mapped" in proc.stderr, \
        proc.stderr[-2000:]
    assert [(op["op"], op["ok"]) for op in _ops(log)] == [("host_map", False), ("host_map", True), ("host_map", True),
                                                          ("host_unmap", True), ("host_unmap", True)]


def test_a_split_model_pins_what_the_single_file_pins(patched_build, src, model, split_model, pin_off, tmp_path):
    one, split = tmp_path / "one.jsonl", tmp_path / "split.jsonl"
    single = _run(patched_build, src, model, {"GGML_SIM_OPLOG": str(one)})
    got = _run(patched_build, src, split_model, {"GGML_SIM_OPLOG": str(split)})
    # before ranges were kept within a shard, a range merged across shards hit a hole, SIM refused it, and every
    # expert was copied instead ("copied into pinned memory ... registration with SIM0 failed")
    assert REFUSED not in got.log and got.log.count("llama_moe: ") == 1, _pin_lines(got.log)
    assert _pinned_expert_mib(got.log) == _pinned_expert_mib(single.log)
    ranges = _model_ranges(split)
    assert len(ranges) >= 3, ranges  # at least one per shard: none spans two mappings
    # the planted case: two of the split's ranges (necessarily of two shards, since inside one mapping ranges
    # this close are one) lie closer than the gap the old code merged across
    gaps = [b_ptr - (a_ptr + a_size) for (a_ptr, a_size), (b_ptr, _) in zip(ranges, ranges[1:])]
    assert min(gaps) < MAX_GAP, f"the shards were mapped far apart ({gaps}): the case this test plants did not occur"
    assert got.logits_sha256 == pin_off.logits_sha256 and got.generated == pin_off.generated


def test_a_range_that_fails_costs_only_its_own_experts(patched_build, src, split_model, pin_off, tmp_path):
    # the second shard's range is refused: the other two stay registered, its experts (layer 1's) are copied
    log = tmp_path / "ops.jsonl"
    got = _run(patched_build, src, split_model, {"GGML_SIM_HOST_MAP_FAIL_NTH": "2", "GGML_SIM_OPLOG": str(log)})
    assert got.log.count("llama_moe: ") == 1 and SPLIT_KEPT in got.log, _pin_lines(got.log)
    assert "copied into pinned memory (SIM_Host) since 1 range(s) failed to register" in got.log, _pin_lines(got.log)
    ops = _ops(log)
    attempts = [op for op in ops if op["op"] == "host_map" and op["refs"] <= 1]
    assert [op["ok"] for op in attempts] == [True, False, True], attempts
    kept = {op["ptr"] for op in attempts if op["ok"]}
    # the kept ranges are referenced by the context too, and released at the end
    for ptr in kept:
        assert [(op["op"], op["refs"]) for op in ops if op["ptr"] == ptr] == [
            ("host_map", 1), ("host_map", 2), ("host_unmap", 1), ("host_unmap", 0)]
    sets = [op for op in _ops(log, ("set",)) if "_exps" in op["tensor"] and op["dev"] == "SIM_Host"]
    assert sorted(op["tensor"] for op in sets) == sorted(f"blk.1.ffn_{w}_exps.weight" for w in ("gate", "up", "down"))
    assert got.logits_sha256 == pin_off.logits_sha256 and got.generated == pin_off.generated


def test_a_range_that_fails_with_no_room_for_a_copy_keeps_the_others(patched_build, src, split_model, pin_off,
                                                                   tmp_path):
    # a budget that takes the first two shards' ranges, not the third's: the first is refused, the second stays
    # registered, and a copy of the rest (the first and third shards' experts) does not fit what is left of it
    plain = tmp_path / "plain.jsonl"
    _run(patched_build, src, split_model, {"GGML_SIM_OPLOG": str(plain)})
    r1, r2, r3 = [op["bytes"] for op in _ops(plain) if op["op"] == "host_map" and op["refs"] == 1]  # file order
    budget_mib = -(-(r1 + r2) // (1 << 20))
    # under a MiB is left for the third range: not even one piece of it (a layer's experts) fits
    assert budget_mib << 20 < r1 + r2 + min(r3, 1 << 20), (r1, r2, r3)
    log = tmp_path / "ops.jsonl"
    got = _run(patched_build, src, split_model, {"GGML_SIM_HOST_MAP_FAIL_NTH": "1", "GGML_SIM_OPLOG": str(log),
                                                  "LLAMA_MOE_PIN_BUDGET_MIB": str(budget_mib)})
    assert got.log.count("llama_moe: ") == 1, _pin_lines(got.log)
    assert re.search(r"MiB of 6.38 MiB of expert weights registered with SIM0 \(page-locked in place: 1 range\(s\), "
                     r"[0-9.]+ MiB\); the rest stays pageable: 1 range\(s\) failed to register and a pinned copy needs "
                     rf".* besides the registered ranges, and a budget of {budget_mib}.00 MiB", got.log), _pin_lines(got.log)
    assert [size for _, size in _model_ranges(log)] == [r2]
    assert got.logits_sha256 == pin_off.logits_sha256 and got.generated == pin_off.generated
