import json
import shutil
from pathlib import Path

import pytest

from pyllama_moe.build import ffi
from pyllama_moe.build.builder import Build, BuildSpec, build, build_key, find_build, read_stamp, STAMP_NAME
from pyllama_moe.build.info import embedded_mismatch, parse_build_info
from pyllama_moe.errors import UserError
from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR
from pyllama_moe.progress import Progress
from pyllama_moe.source.trees import Tree


def test_master_key_ignores_patch_inputs_and_patched_key_follows_them(tmp_path):
    master_a = BuildSpec(Tree("master", tmp_path, "pin:x", ""))
    patched_a = BuildSpec(Tree("patched", tmp_path, "pin:x", "inputs-a"))
    patched_b = BuildSpec(Tree("patched", tmp_path, "pin:x", "inputs-b"))
    assert "patch_inputs" not in build_key(master_a)[1]
    assert build_key(patched_a)[0] != build_key(patched_b)[0]
    assert build_key(patched_a)[0] == build_key(BuildSpec(Tree("patched", tmp_path, "pin:x", "inputs-a")))[0]
    other_opts = BuildSpec(Tree("master", tmp_path, "pin:x", ""), extra_options=("-DGGML_OPENMP=OFF",))
    assert build_key(master_a)[0] != build_key(other_opts)[0]
    assert build_key(master_a)[0] != build_key(BuildSpec(Tree("master", tmp_path, "pin:y", "")))[0]


def test_cuda_backend_without_nvcc_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDACXX", raising=False)
    monkeypatch.setattr("pyllama_moe.build.builder.tool_path", lambda name: "/usr/bin/cmake")
    monkeypatch.setattr("pyllama_moe.build.builder._first_line", lambda cmd: "some compiler 1.0")
    with pytest.raises(UserError, match="--backend cuda needs nvcc"):
        build_key(BuildSpec(Tree("master", tmp_path, "pin:x", ""), backend="cuda", cuda_arch="90-real"))


def _fake_smi(folder, body):
    smi = folder / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + body + "\n")
    smi.chmod(0o755)


def test_a_cuda_build_is_for_the_gpus_present_unless_told(tmp_path, monkeypatch):
    # llama.cpp's own CMake builds for the GPU present ("native"); the key must say which, so it is spelled out
    monkeypatch.setenv("PATH", str(tmp_path))
    _fake_smi(tmp_path, "printf '9.0\\n8.6\\n9.0\\n'")
    tree = Tree("master", tmp_path, "pin:x", "")
    assert BuildSpec(tree, backend="cuda").cuda_arch == "86-real;90-real"
    assert "-DCMAKE_CUDA_ARCHITECTURES=86-real;90-real" in BuildSpec(tree, backend="cuda").options()
    assert BuildSpec(tree, backend="cuda", cuda_arch="89-real").cuda_arch == "89-real"
    assert BuildSpec(tree).cuda_arch == "native"  # a CPU build asks nothing of nvidia-smi


@pytest.mark.parametrize("smi", [None, "exit 9", "echo 'No devices were found'"])
def test_no_gpu_to_build_for_names_the_flag(tmp_path, monkeypatch, smi):
    monkeypatch.setenv("PATH", str(tmp_path))
    if smi is not None:
        _fake_smi(tmp_path, smi)
    with pytest.raises(UserError, match="builds for the GPU present by default") as err:
        BuildSpec(Tree("master", tmp_path, "pin:x", ""), backend="cuda")
    assert "--cuda-arch" in err.value.fix


def test_failed_build_leaves_other_builds_alone(tmp_path, patched_build, master_build, monkeypatch):
    monkeypatch.setenv("PYLLAMA_MOE_HOME", str(tmp_path / "home"))
    broken = tmp_path / "tree"
    broken.mkdir()
    (broken / "CMakeLists.txt").write_text("this is not cmake(\n")
    with pytest.raises(UserError, match=r"configure master failed .*full log: .*build.log"):
        build(BuildSpec(Tree("master", broken, "pin:broken", "")))
    failed_dirs = [p for p in (tmp_path / "home" / "builds").iterdir() if p.is_dir()]
    assert len(failed_dirs) == 1 and read_stamp(failed_dirs[0]) is None
    for good in (patched_build, master_build):
        assert read_stamp(good.path)["key"] == good.key


def test_unstamped_dir_is_not_a_build(tmp_path, monkeypatch):
    monkeypatch.setenv("PYLLAMA_MOE_HOME", str(tmp_path))
    with pytest.raises(UserError, match="no finished master/cpu build"):
        find_build("master", "cpu", "0123")


def test_loader_accepts_the_patched_build_and_reads_its_key(patched_build):
    lib = ffi.load(patched_build)
    info = lib.build_info()
    assert info["key"] == patched_build.key and info["variant"] == "patched"
    assert info["pin"].endswith("@0c1e57098")


def test_master_has_no_symbol_of_ours(master_build):
    lib = ffi.load(master_build)
    assert lib.build_info() is None
    with pytest.raises(AttributeError):
        lib.llama_moe_build_info


def test_loader_refuses_a_key_that_is_not_stamped(patched_build):
    wrong = Build(patched_build.path, "0" * 24, "patched", "cpu")
    with pytest.raises(UserError, match="is not a finished build with key 000"):
        ffi.load(wrong)


def test_loader_refuses_a_library_whose_embedded_key_differs(patched_build, tmp_path):
    fake = tmp_path / "fake-build"
    shutil.copytree(patched_build.bin_dir, fake / "bin", symlinks=True)
    stamp = read_stamp(patched_build.path)
    stamp["key"] = "f" * 24
    (fake / STAMP_NAME).write_text(json.dumps(stamp))
    with pytest.raises(UserError, match=f"embeds key {patched_build.key}"):
        ffi.load(Build(fake, "f" * 24, "patched", "cpu"))


def test_loader_refuses_master_presented_as_patched(master_build):
    with pytest.raises(UserError, match="not a patched build"):
        ffi.load(Build(master_build.path, master_build.key, "patched", "cpu"))


def test_cdef_comes_from_the_header_alone():
    cdef = ffi.cdef_from_header()
    assert "llama_moe_build_info" in ffi.declared_functions(cdef)
    assert "#" not in cdef


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(UserError, match="no working C/C\\+\\+ compiler .*no-such-cc.* install gcc"):
        build_key(BuildSpec(Tree("master", tmp_path, "pin:x", "")))


def test_worker_refuses_a_library_whose_embedded_key_differs(patched_build, src, tmp_path):
    # the stamp passes the parent's check; the worker process must still refuse the library it loaded
    fake = tmp_path / "fake-build"
    shutil.copytree(patched_build.bin_dir, fake / "bin", symlinks=True)
    stamp = read_stamp(patched_build.path)
    stamp["key"] = "f" * 24
    (fake / STAMP_NAME).write_text(json.dumps(stamp))
    model = models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])
    spec = runner.RunSpec(model=model, tokens=[16, 17, 18], threads=1)
    with pytest.raises(UserError, match=f"embeds key {patched_build.key} \\(patched\\), not the patched build f{{24}}"):
        runner.run(Build(fake, "f" * 24, "patched", "cpu"), src, spec)


def test_build_progress_in_a_log_is_a_line_per_update_and_a_line_when_done(capsys):
    # stderr is captured, not a terminal: lines a log can hold, not a bar redrawn with carriage returns
    progress = Progress("build master/cpu", quiet_for=0, log_every=0)
    for n in range(1, 4):
        progress.total = 3  # as _run_logged learns it: from ninja's first [n/m] line
        progress.update(n)
    progress.finish("done")
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert lines[-2:-1] == ["build master/cpu: 3 / 3 (100%, 00:00 left)"], err
    assert lines[-1].startswith("build master/cpu: done (") and len(lines) <= 5, err


def test_a_quick_step_says_nothing_but_its_note(capsys):
    quiet = Progress("synth m.gguf", 3_000_000, "B")
    quiet.update(step=1_000_000)
    assert quiet.finish() < 2.0 and capsys.readouterr().err == ""
    noted = Progress("configure master")
    noted.finish("done")
    assert capsys.readouterr().err.startswith("configure master: done (")


def test_embedded_build_info_rule():
    path = Path("libllama.so")
    good = {"key": "k1", "variant": "patched"}
    assert embedded_mismatch("patched", "k1", good, path) is None
    assert embedded_mismatch("master", "k0", None, path) is None
    assert "not a master build" in embedded_mismatch("master", "k0", good, path)
    assert "not a patched build" in embedded_mismatch("patched", "k1", None, path)
    assert "embeds key k1 (patched), not the patched build k2" in embedded_mismatch("patched", "k2", good, path)
    assert parse_build_info("key=k1;variant=patched;pin=0.3.36@abc") == {"key": "k1", "variant": "patched", "pin": "0.3.36@abc"}


def test_every_verb_prints_its_help():
    """argparse formats help strings with %: a bare '95%' in one verb's help broke `pyllama-moe --help`."""
    import argparse

    from pyllama_moe.cli.main import build_parser

    parser = build_parser()
    parser.format_help()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in verbs.choices.items():
        assert sub.format_help(), name
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                for subsub in action.choices.values():
                    assert subsub.format_help()
