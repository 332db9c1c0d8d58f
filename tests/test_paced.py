"""The paced benchmark driver (tools/paced-bench) and its Python side (pyllama_moe.bench.paced_process) on the CPU builds.

What these tests do not prove: that the driver's timings match llama-bench's (no timing is asserted beyond
ns > 0), or that -ncmoe / -lm none place tensors as on a GPU (on the CPU build they change little); they show
that both builds compile it, that processes of both load side by side and answer each command, and that every
failure reaches the caller as a UserError that says what happened.
"""

from __future__ import annotations

import re

import pytest

from pyllama_moe.bench import paced_process as paced
from pyllama_moe.errors import UserError
from pyllama_moe.harness import models
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR

pytestmark = pytest.mark.build


@pytest.fixture(scope="module")
def model():
    return models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])


@pytest.fixture(scope="module")
def tools(master_build, patched_build):
    return {"master": paced.ensure_tool(master_build), "patched": paced.ensure_tool(patched_build)}


def _spec(model, **kw):
    return paced.PacedSpec(model=model, n_prompt=64, n_gen=8, n_threads=2, **kw)


def _check(reply, kind, n_tokens):
    assert reply["kind"] == kind
    assert reply["n_tokens"] == n_tokens
    assert isinstance(reply["ns"], int) and reply["ns"] > 0


def test_tool_compiles_per_build_and_is_reused(master_build, patched_build, tools):
    for build, exe in ((master_build, tools["master"]), (patched_build, tools["patched"])):
        assert exe.is_file() and exe.parent == build.path / "pyllama-moe-tools"
        mtime = exe.stat().st_mtime_ns
        again = paced.ensure_tool(build)
        assert again == exe and again.stat().st_mtime_ns == mtime
    assert tools["master"].name == tools["patched"].name  # same source, same content name


def test_both_builds_load_side_by_side_and_answer(model, tools):
    with paced.PacedProcess(tools["master"], _spec(model), label="master") as a, \
         paced.PacedProcess(tools["patched"], _spec(model), label="patched") as b:
        a.wait_ready(300)  # both were started before either is waited for
        b.wait_ready(300)
        for proc in (a, b, b, a):
            _check(proc.run("tg 1"), "tg", 1)
            _check(proc.run("tg"), "tg", 8)
            _check(proc.run("pp"), "pp", 64)
            _check(proc.run("pp 100"), "pp", 100)
    assert a.returncode == 0 and b.returncode == 0


@pytest.mark.parametrize("kw", [dict(n_cpu_moe=2), dict(load_mode="none"), dict(load_mode="mmap", flash_attn="on",
                                                                               n_batch=32, n_ubatch=16)])
def test_placement_and_load_options_are_accepted(model, tools, kw):
    with paced.PacedProcess(tools["patched"], _spec(model, **kw)) as proc:
        proc.wait_ready(300)
        _check(proc.run("pp"), "pp", 64)  # with n_batch 32 this is two batches of two ubatches
        _check(proc.run("tg"), "tg", 8)


def test_a_bad_command_is_refused_and_the_process_keeps_serving(model, tools):
    with paced.PacedProcess(tools["master"], _spec(model)) as proc:
        proc.wait_ready(300)
        with pytest.raises(UserError, match="unknown command 'bogus'"):
            proc.run("bogus")
        with pytest.raises(UserError, match="larger -c"):
            proc.run("pp 100000")
        _check(proc.run("tg 1"), "tg", 1)
    assert proc.returncode == 0


def test_a_generation_only_process_has_no_prompt_default(model, tools):
    # bench --paced starts one test kind per process, llama-bench style: -p 0 -n N
    with paced.PacedProcess(tools["patched"], paced.PacedSpec(model=model, n_prompt=0, n_gen=8, n_threads=2)) as proc:
        proc.wait_ready(300)
        _check(proc.run("tg"), "tg", 8)
        with pytest.raises(UserError, match="missing token count"):
            proc.run("pp")
        _check(proc.run("pp 16"), "pp", 16)


def test_a_missing_model_names_the_driver_error(tools, tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    with paced.PacedProcess(tools["master"], _spec(missing), log_path=tmp_path / "driver.log") as proc:
        with pytest.raises(UserError) as err:
            proc.wait_ready(60)
    assert f"error: model file '{missing}' cannot be opened" in str(err.value)
    assert proc.returncode == 1


BROKEN_COMPILER = """#!/bin/sh
# writes half a binary to its -o argument, then fails, like a compiler killed or failing at link time
while [ $# -gt 0 ]; do [ "$1" = -o ] && echo half > "$2"; shift; done
exit 1
"""


@pytest.mark.parametrize("compiler", ["false", "half-writer"])
def test_a_failed_compile_leaves_no_tool(master_build, monkeypatch, tmp_path, compiler):
    # a source of its own (so a good binary of the real source cannot already sit under the final name), the
    # same content each run, so the cache gains no file
    source = tmp_path / paced.TOOL_SOURCE.name
    source.write_bytes(paced.TOOL_SOURCE.read_bytes() + b"\n// test_a_failed_compile_leaves_no_tool\n")
    monkeypatch.setattr(paced, "TOOL_SOURCE", source)
    if compiler == "half-writer":
        script = tmp_path / "cxx"
        script.write_text(BROKEN_COMPILER)
        script.chmod(0o755)
        compiler = str(script)
    monkeypatch.setenv("CXX", compiler)
    with pytest.raises(UserError, match="failed \\(exit 1\\)") as err:
        paced.ensure_tool(master_build)
    tools_dir = master_build.path / "pyllama-moe-tools"
    log = next(p for p in tools_dir.glob("*.log") if str(p) in str(err.value))
    final = log.with_name(log.name[: -len(".log")])
    assert [p.name for p in tools_dir.glob(final.name + "*")] == [log.name]  # no binary, no partial one
    log.unlink()


def test_a_late_answer_stops_the_process(model, tools, tmp_path):
    with paced.PacedProcess(tools["master"], _spec(model, n_ctx=4096), log_path=tmp_path / "driver.log") as proc:
        proc.wait_ready(300)
        with pytest.raises(UserError, match="did not answer within"):
            proc.run("pp 4000", timeout=0.001)
        assert proc.proc.poll() is not None  # its answer can no longer pair with a later command


def test_a_generation_in_chunks_continues_where_the_last_chunk_stopped(model, tools):
    def cells_left(proc):
        with pytest.raises(UserError, match="the context left") as refused:
            proc.run("tg-more 1000000")
        return int(re.search(r"at most (\d+)", str(refused.value)).group(1))

    with paced.PacedProcess(tools["master"], _spec(model)) as proc:
        proc.wait_ready(300)
        with pytest.raises(UserError, match="send tg-start first"):
            proc.run("tg-more 2")
        assert proc.run("tg-start") == {"kind": "tg-start", "n_tokens": 0, "ns": 0}
        n_ctx = cells_left(proc)
        _check(proc.run("tg-more 3"), "tg-more", 3)
        _check(proc.run("tg-more 60"), "tg-more", 60)
        assert cells_left(proc) == n_ctx - 63  # the chunks continue one generation
        assert proc.run("tg-start")["kind"] == "tg-start"
        assert cells_left(proc) == n_ctx  # and a new one starts from an empty memory
        with pytest.raises(UserError, match="bad token count"):
            proc.run("tg-more x")
        _check(proc.run("pp 8"), "pp", 8)
        assert cells_left(proc) == n_ctx - 8  # after a prompt, the generation continues it
        _check(proc.run("tg-more 2"), "tg-more", 2)
        _check(proc.run("tg 1"), "tg", 1)
        with pytest.raises(UserError, match="send tg-start first"):  # a whole tg test ends the chunked one
            proc.run("tg-more 1")
    assert proc.returncode == 0


def test_a_fresh_expert_cache_on_the_patched_build_and_a_clear_refusal_on_master(model, tools):
    # moe-cache-reset and moe-cache-counters call llama-moe.h, which the driver includes where the tree has it: not master
    with paced.PacedProcess(tools["master"], _spec(model)) as proc:
        proc.wait_ready(300)
        with pytest.raises(UserError, match="this build has no expert cache"):
            proc.run("moe-cache-reset")
        with pytest.raises(UserError, match="this build has no expert cache"):
            proc.run("moe-cache-counters")
        _check(proc.run("pp 8"), "pp", 8)  # and it keeps serving
    with paced.PacedProcess(tools["patched"], _spec(model)) as proc:
        proc.wait_ready(300)
        reply = proc.run("moe-cache-reset")
        assert reply["kind"] == "moe-cache-reset" and reply["ns"] > 0
        _check(proc.run("pp 8"), "pp", 8)
        counters = proc.run("moe-cache-counters")  # no cache made (LLAMA_MOE_CACHE_MIB unset): zeros
        assert counters["kind"] == "moe-cache-counters" and counters["hits"] == counters["misses"] == 0
        more = proc.run("tg-more 2")
        assert 0 < more["first_ns"] < more["ns"]
        assert len(more["token_ns"]) == 2 and more["token_ns"][0] == more["first_ns"] and sum(more["token_ns"]) <= more["ns"]


def test_the_decode_times_knob_times_the_first_decode_steps_after_each_prompt(model, tools, tmp_path):
    # LLAMA_MOE_DEBUG_DECODE_TIMES=2: the first two decode ubatches after each larger one say on stderr where their host
    # time went (the first builds and allocates its graph, the second reuses it) and how long the synchronization then
    # waited
    log = tmp_path / "driver.log"
    with paced.PacedProcess(tools["patched"], _spec(model), {"LLAMA_MOE_DEBUG_DECODE_TIMES": "2"}, log_path=log) as proc:
        proc.wait_ready(300)
        for _ in range(2):
            _check(proc.run("pp 16"), "pp", 16)
            _check(proc.run("tg-more 3"), "tg-more", 3)
    steps = re.findall(r"llama_moe: decode step (\d) after a prompt \(1 tokens\): graph (reused|built) [\d.]+ ms, "
                       r"(?:allocated [\d.]+ ms, )?inputs [\d.]+ ms, expert cache bind [\d.]+ ms \(waiting [\d.]+, slot states [\d.]+\), "
                       r"compute queued [\d.]+ ms", log.read_text())
    assert steps == [("1", "built"), ("2", "reused")] * 2, steps
    assert len(re.findall(r"llama_moe: decode step \d after a prompt: synchronize [\d.]+ ms", log.read_text())) == 4
    # unset: not a line
    with paced.PacedProcess(tools["patched"], _spec(model), log_path=tmp_path / "quiet.log") as proc:
        proc.wait_ready(300)
        proc.run("pp 16")
        proc.run("tg-more 3")
    assert "decode step" not in (tmp_path / "quiet.log").read_text()
