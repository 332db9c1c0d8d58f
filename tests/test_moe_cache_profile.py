"""Expert cache profiles, on SIM: LLAMA_MOE_CACHE_PROFILE=FILE (--moe-cache-profile) writes per-layer
expert use counts when the context is freed and, where the file exists and was made for the model, fills the cache
from it when it is made. A profile of another model, a corrupt one or one of another version is refused with one
line and changes nothing, the file included. The logits are those of the cache off in every case: only what is
resident changes.

The model is tests/test_moe_cache_seed.py's skewed tiny qwen3moe (4 layers of 16 experts), whose 2 MiB cache holds 5
experts a layer. What the profile counts: each decode lookup that planned adds 1 to each distinct expert it routed
(so a layer's decode counts sum to its hits + misses), each seeding ubatch its routed tokens."""
from __future__ import annotations

import os

import numpy as np
import pytest

from pyllama_moe.build.ffi import decode_hit_rate
from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR
from pyllama_moe.plot import profile

SIM_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "GGML_SIM_COPY_LATENCY_US": "50", "GGML_SCHED_PREFETCH": "2"}
PROMPT = [(i * 7919) % 4000 + 16 for i in range(512)]  # 4 ubatches of 128 that upload ahead: the last one seeds
SHORT = PROMPT[:16]  # below the prefetch's min batch (128): nothing uploads ahead, nothing seeds
UBATCH = 128
N_LAYERS, N_EXPERT, N_SLOTS = 4, 16, 5
CACHE_MIB = 2


def _definition(**extra):
    return {**load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"], "skew": 2.0, **extra}


@pytest.fixture(scope="module")
def model():
    return models.ensure_model("qwen3moe-skew2", _definition())


@pytest.fixture(scope="module")
def other_model():
    # the same shape from another seed: other routers
    return models.ensure_model("qwen3moe-skew2-seed7", _definition(seed=7))


def _run(build, src, model, profile_path=None, cache_mib=CACHE_MIB, env=None, **spec):
    fields = dict(model=model, tokens=PROMPT, cpu_moe=True, load_mode="none", repack=False, threads=2, n_ubatch=UBATCH,
                  n_batch=512, generate=8, stats=True,
                  env={**SIM_ENV, "LLAMA_MOE_CACHE_MIB": str(cache_mib),
                       **({"LLAMA_MOE_CACHE_PROFILE": str(profile_path)} if profile_path is not None else {}), **(env or {})})
    return runner.run(build, src, runner.RunSpec(**{**fields, **spec}))


def _same(a, b):
    assert a.logits_sha256 == b.logits_sha256
    assert a.generated == b.generated and a.decode_logits_sha256 == b.decode_logits_sha256


def _decode(result):
    return result.stats["generate"]["cache_decode"]


@pytest.fixture(scope="module")
def written(patched_build, src, model, tmp_path_factory):
    """A first run: no file yet, written when the context is freed."""
    path = tmp_path_factory.mktemp("profile") / "heat.gguf"
    return path, _run(patched_build, src, model, path)


def test_a_run_writes_the_profile_that_the_gguf_package_reads(written):
    path, result = written
    assert "not there yet, written when the context is freed" in result.log
    assert "refused" not in result.log
    p = profile.read(path)
    assert (p.arch, p.n_layer, p.n_expert, p.n_runs) == ("qwen3moe", N_LAYERS, N_EXPERT, 1)
    assert p.decode.shape == p.prompt.shape == (N_LAYERS, N_EXPERT)
    # decode: each distinct expert once per lookup, so the counts sum to the counters' hits + misses, layer by layer
    d = _decode(result)
    assert d["n_ubatches"] > 0 and d["n_overflow"] == 0 and d["n_in_place"] == 0
    assert int(p.decode.sum()) == d["n_hits"] + d["n_misses"] > 0  # (layer by layer: the planner case profile-counts)
    assert all(int(p.decode[il].sum()) > 0 for il in range(N_LAYERS))
    # prompt: the routed tokens of the seeding ubatch (the last 128 of the prompt, top-k each), every layer
    assert result.stats["prompt"]["cache_prompt"]["n_seeded"] > 0
    assert all(int(p.prompt[il].sum()) == UBATCH * p.n_expert_used for il in range(N_LAYERS)), p.prompt.sum(axis=1)
    # the skew shows: a few experts take most of each layer's routings
    assert all(np.sort(p.decode[il])[-N_SLOTS:].sum() > 0.5 * p.decode[il].sum() for il in range(N_LAYERS))
    # written atomically: no temporary file is left beside it
    assert sorted(f.name for f in path.parent.iterdir()) == ["heat.gguf"]


def test_counts_accumulate_over_runs(patched_build, src, model, written, tmp_path):
    path, first = written
    copy = tmp_path / "again.gguf"
    copy.write_bytes(path.read_bytes())
    second = _run(patched_build, src, model, copy)
    a, b = profile.read(path), profile.read(copy)
    assert b.n_runs == 2
    d = _decode(second)
    assert int(b.decode.sum()) == int(a.decode.sum()) + d["n_hits"] + d["n_misses"]
    assert int(b.prompt.sum()) == 2 * int(a.prompt.sum())
    assert "expert cache profile" in second.log and "4 layers filled, 20 experts" in second.log, second.log[-3000:]


@pytest.fixture(scope="module")
def reference_short(patched_build, src, model):
    return _run(patched_build, src, model, cache_mib=0, tokens=SHORT, generate=16)


def test_a_saved_profile_makes_the_first_decode_tokens_of_a_fresh_process_hit(patched_build, src, model, written,
                                                                            reference_short, tmp_path):
    # a short prompt (no upload ahead: nothing seeds): the cache starts from the profile or empty. The first tokens
    # show it most (the empty cache misses every expert of the first token: 0.54 against 0.83 over the first 3 decode
    # steps here); over 16 tokens the empty cache catches up most of the way, and still hits less
    path, _ = written
    reference4 = _run(patched_build, src, model, cache_mib=0, tokens=SHORT, generate=4)
    rates = {}
    for n_gen, reference in ((4, reference4), (16, reference_short)):
        copy = tmp_path / f"p{n_gen}.gguf"
        copy.write_bytes(path.read_bytes())
        with_profile = _run(patched_build, src, model, copy, tokens=SHORT, generate=n_gen)
        without = _run(patched_build, src, model, tokens=SHORT, generate=n_gen)
        _same(with_profile, reference)
        _same(without, reference)
        assert f"{N_LAYERS} layers filled, {N_LAYERS * N_SLOTS} experts" in with_profile.log, with_profile.log[-3000:]
        assert with_profile.stats["prompt"]["cache_prompt"]["n_seeded"] == 0
        rates[n_gen] = decode_hit_rate(_decode(with_profile)), decode_hit_rate(_decode(without))
    assert rates[4][0] > rates[4][1] + 0.2, rates
    assert rates[16][0] > rates[16][1], rates


def _refused(result, path, what, fix="delete it"):
    line = next((ln for ln in result.log.splitlines() if "expert cache profile" in ln and "refused" in ln), "")
    assert str(path) in line and what in line and fix in line and "--moe-cache-profile" in line, result.log[-3000:]
    assert sum("expert cache profile" in ln and "refused" in ln for ln in result.log.splitlines()) == 1


def test_a_profile_of_another_model_is_refused_and_changes_nothing(patched_build, src, model, other_model, written,
                                                                  tmp_path):
    path, _ = written
    copy = tmp_path / "p.gguf"
    copy.write_bytes(path.read_bytes())
    before = copy.read_bytes()
    got = _run(patched_build, src, other_model, copy, tokens=SHORT, generate=8)
    plain = _run(patched_build, src, other_model, tokens=SHORT, generate=8)
    _refused(got, copy, "was made for another model")
    assert "layers filled" not in got.log
    _same(got, plain)
    assert decode_hit_rate(_decode(got)) == decode_hit_rate(_decode(plain))  # the cache started empty, as without it
    assert copy.read_bytes() == before  # not overwritten at exit
    assert sorted(f.name for f in tmp_path.iterdir()) == ["p.gguf"]


def test_run_shows_the_builds_refusal_and_goes_on(patched_build, model, other_model, written, tmp_path, monkeypatch,
                                                  capsys):
    """`pyllama-moe run`: a profile that only the build can tell is another model's (same shape, other routers) is
    refused by the build, and the run goes on with the build's error line on stderr (docs/cli.md, Errors)."""
    from pyllama_moe.cli.main import main

    path, _ = written
    copy = tmp_path / "p.gguf"
    copy.write_bytes(path.read_bytes())
    monkeypatch.setenv("GGML_SIM_DEVICES", "1")
    assert main(["run", str(other_model), "--no-build", "-cmoe", "-mcm", str(CACHE_MIB), "-n", "4",
                 "--moe-cache-profile", str(copy)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if "refused" in line] == [line for line in err if line.startswith("llama_moe:")]
    assert len(err) == 1 and str(copy) in err[0] and "was made for another model" in err[0]
    assert copy.read_bytes() == path.read_bytes()


def _other_version(path, version):
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_string("pyllama_moe.profile.format", profile.FORMAT)
    w.add_uint32("pyllama_moe.profile.version", version)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["truncated", "garbage", "version", "not-a-profile"])
def test_a_corrupt_profile_is_refused_and_left_as_it_is(patched_build, src, model, written, reference_short, tmp_path, kind):
    path, _ = written
    bad = tmp_path / "bad.gguf"
    what = {"truncated": "is truncated or corrupt", "garbage": "is not a GGUF file", "version": "has format version 2",
            "not-a-profile": "not an expert cache profile"}[kind]
    if kind == "truncated":
        bad.write_bytes(path.read_bytes()[: len(path.read_bytes()) - 40])
    elif kind == "garbage":
        bad.write_bytes(b"not a profile\n" * 20)
    elif kind == "version":
        _other_version(bad, 2)
    else:
        import gguf

        w = gguf.GGUFWriter(str(bad), "qwen3moe")
        w.add_uint32("something.else", 1)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    before = bad.read_bytes()
    got = _run(patched_build, src, model, bad, tokens=SHORT, generate=16)
    _refused(got, bad, what)
    _same(got, reference_short)
    assert bad.read_bytes() == before
    assert sorted(f.name for f in tmp_path.iterdir()) == ["bad.gguf"]


def test_an_unwritable_place_logs_one_error_and_the_run_succeeds(patched_build, src, model, reference_short, tmp_path):
    path = tmp_path / "no-such-dir" / "p.gguf"  # (as root, a read-only directory would still be written)
    got = _run(patched_build, src, model, path, tokens=SHORT, generate=16)
    _same(got, reference_short)
    errors = [ln for ln in got.log.splitlines() if "expert cache profile" in ln and "not written" in ln]
    assert len(errors) == 1 and str(path) in errors[0] and "cannot create" in errors[0], got.log[-3000:]
    assert not path.parent.exists()


def test_the_device_lookup_counts_what_the_host_side_plan_counts(patched_build, src, model, tmp_path):
    # the same run, decode looked up on the (SIM) device or planned on the host: the same counts, expert by expert
    dev, host = tmp_path / "device.gguf", tmp_path / "host.gguf"
    a = _run(patched_build, src, model, dev, generate=16)
    b = _run(patched_build, src, model, host, generate=16, env={"LLAMA_MOE_CACHE_DEVICE": "0"})
    assert "decode looks up its slots and fills its misses on the device" in a.log
    assert "decode plans 4 of 4 layers on the host" in b.log
    _same(a, b)
    pa, pb = profile.read(dev), profile.read(host)
    assert int(pa.decode.sum()) > 0
    assert np.array_equal(pa.decode, pb.decode), (pa.decode, pb.decode)
    assert np.array_equal(pa.prompt, pb.prompt)


def test_profile_show_and_the_heat_map(written, tmp_path, capsys):
    from pyllama_moe.cli.main import main

    path, _ = written
    assert main(["profile", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "qwen3moe, 4 layers, 16 experts" in out and out.count("layer ") >= N_LAYERS
    p = profile.read(path)
    top = min(range(N_EXPERT), key=lambda e: (-int(p.decode[0][e]), -int(p.prompt[0][e]), e))
    assert f"layer   0: decode {int(p.decode[0].sum()):9d}" in out and f"top {top}:" in out
    svg = tmp_path / "heat.svg"
    assert main(["plot", "--profile", str(path), "-o", str(svg)]) == 0
    assert svg.read_text().lstrip().startswith("<?xml")
    # not a profile: one error, exit 2
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"junk")
    assert main(["profile", "show", str(junk)]) == 2
    assert "is not a GGUF file" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["large", "fifo", "directory"])
def test_what_cannot_be_a_profile_is_refused_unread(patched_build, src, model, reference_short, tmp_path, kind):
    # a model or a disk image passed by mistake was read into memory whole (twice) before its keys said it was no profile
    # (1 GiB: 2 GiB of memory; more could end the process), and a FIFO blocked the context's creation: both are refused
    # by what the path is, before anything is read
    import os
    import threading

    bad = tmp_path / "bad.gguf"
    writer = None
    if kind == "large":
        with open(bad, "wb") as f:  # sparse: costs nothing on the disk
            f.write(b"GGUF")
            f.truncate(1 << 30)
        what = "more than a profile of this model can be"
    elif kind == "fifo":
        os.mkfifo(bad)
        # a writer, so that a reader that opens it (the old behaviour) does not hang the test: it finds it empty
        writer = threading.Thread(target=lambda: open(bad, "wb").close(), daemon=True)
        writer.start()
        what = "is not a regular file"
    else:
        bad.mkdir()
        what = "is not a regular file"
    got = _run(patched_build, src, model, bad, tokens=SHORT, generate=16)
    # a file too large to be a profile may be deleted; a FIFO or a directory is the wrong path
    _refused(got, bad, what, "delete it" if kind == "large" else "pass the path of a profile file")
    _same(got, reference_short)
    if kind == "large":
        assert bad.stat().st_size == 1 << 30 and bad.read_bytes()[:4] == b"GGUF"
    if writer is not None and writer.is_alive():
        os.close(os.open(bad, os.O_RDONLY | os.O_NONBLOCK))  # nobody opened it: release the writer
        writer.join(5)


def test_two_processes_sharing_a_profile_both_add_their_counts(patched_build, src, model, written, tmp_path):
    # each process reads the file when it is freed, adds its counts and renames its own file over it: without a lock
    # across processes, the second rename dropped the first one's counts. A debug delay holds each write's read and
    # rename apart, so that the two processes' windows overlap
    from concurrent.futures import ThreadPoolExecutor

    path, _ = written
    shared = tmp_path / "shared.gguf"
    shared.write_bytes(path.read_bytes())
    base = profile.read(shared)
    env = {"LLAMA_MOE_CACHE_DEBUG_PROFILE_WRITE_DELAY_MS": "2000"}
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: _run(patched_build, src, model, shared, env=env), range(2)))
    after = profile.read(shared)
    assert after.n_runs == base.n_runs + 2, (base.n_runs, after.n_runs)
    added = sum(_decode(r)["n_hits"] + _decode(r)["n_misses"] for r in runs)
    assert int(after.decode.sum()) == int(base.decode.sum()) + added
    assert sorted(f.name for f in tmp_path.iterdir()) == ["shared.gguf"]  # no temporary file left


def test_a_rewritten_profile_keeps_its_mode_and_a_new_one_follows_the_umask(patched_build, src, model, written, tmp_path):
    shared = tmp_path / "shared.gguf"
    shared.write_bytes(written[0].read_bytes())
    shared.chmod(0o664)  # shared with a group: the rewrite must not turn it private
    _run(patched_build, src, model, shared, tokens=SHORT, generate=4)
    assert (shared.stat().st_mode & 0o7777) == 0o664
    assert profile.read(shared).n_runs == profile.read(written[0]).n_runs + 1
    old_umask = os.umask(0o027)  # the worker inherits it
    try:
        fresh = tmp_path / "fresh.gguf"
        _run(patched_build, src, model, fresh, tokens=SHORT, generate=4)
    finally:
        os.umask(old_umask)
    assert (fresh.stat().st_mode & 0o7777) == 0o640  # 0644 less the umask, as any file the user makes
    assert not list(tmp_path.glob("*.tmp.*"))


def test_a_relative_profile_path_names_its_place_when_the_cache_is_made(patched_build, src, model, tmp_path, monkeypatch):
    start, later = tmp_path / "start", tmp_path / "later"
    start.mkdir()
    later.mkdir()
    monkeypatch.chdir(start)  # the worker starts here
    _run(patched_build, src, model, "rel.gguf", tokens=SHORT, generate=4, chdir_after_context=str(later))
    assert (start / "rel.gguf").is_file()
    assert not (later / "rel.gguf").exists()
