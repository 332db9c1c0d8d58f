import io
import json
import tarfile

import pytest

from pyllama_moe.errors import UserError
from pyllama_moe.source import packs


@pytest.fixture(scope="module")
def master_archive(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("arch") / "llama.cpp-master.tar.gz"
    manifest = packs.pack("master", out, src)
    return out, manifest


def test_pack_is_pruned_and_every_sdist_file_keeps_its_sdist_hash(master_archive, src):
    _, manifest = master_archive
    files = manifest["files"]
    assert "ggml/src/ggml-backend.cpp" in files and "ggml/src/ggml-cuda/ggml-cuda.cu" in files
    assert not any(rel.startswith(("models/", "docs/", "ggml/src/ggml-vulkan/")) for rel in files)
    # of the web UI only what llama-server's build needs
    assert sorted(rel for rel in files if rel.startswith("tools/ui/")) == sorted(packs.KEEP_FILES)
    assert all(entry["origin"] == "sdist" and entry["sha256"] == src.manifest[rel] for rel, entry in files.items())
    assert "llama_cpp/llama_cpp.py" in manifest["python_files"]


def test_unpacked_archive_is_a_buildable_tree(master_archive, monkeypatch, tmp_path):
    monkeypatch.setenv("PYLLAMA_MOE_HOME", str(tmp_path))
    archive, _ = master_archive
    tree = packs.unpack(archive, "master")
    assert (tree.path / "CMakeLists.txt").is_file() and tree.source_id.startswith("pin:")
    monkeypatch.setenv("PYLLAMA_MOE_HOME", str(tmp_path / "again"))  # a new cache: the manifest is checked again
    with pytest.raises(UserError, match="holds the master tree, not patched"):
        packs.unpack(archive, "patched")


def _rewrite(archive, out, change):
    with tarfile.open(archive, "r:gz") as src_tar, tarfile.open(out, "w:gz") as dst:
        for member in src_tar:
            data = src_tar.extractfile(member).read() if member.isfile() else None
            member, data = change(member, data)
            if member is None:
                continue
            if data is not None:
                member.size = len(data)
                dst.addfile(member, io.BytesIO(data))
            else:
                dst.addfile(member)


def test_a_file_that_differs_from_the_manifest_is_refused(master_archive, tmp_path, monkeypatch):
    monkeypatch.setenv("PYLLAMA_MOE_HOME", str(tmp_path / "home"))
    archive, _ = master_archive
    bad = tmp_path / "tampered.tar.gz"

    def change(member, data):
        if member.name == "llama.cpp/src/llama.cpp":
            data = data + b"\n// tampered\n"
        return member, data

    _rewrite(archive, bad, change)
    with pytest.raises(UserError, match="src/llama.cpp does not match its manifest sha256"):
        packs.unpack(bad, "master")
    assert not list((tmp_path / "home" / "trees").glob("archive-*"))  # nothing half-unpacked left behind


def test_a_missing_file_and_a_truncated_archive_are_refused(master_archive, tmp_path, monkeypatch):
    monkeypatch.setenv("PYLLAMA_MOE_HOME", str(tmp_path / "home"))
    archive, _ = master_archive
    missing = tmp_path / "missing.tar.gz"
    _rewrite(archive, missing, lambda m, d: (None, None) if m.name == "llama.cpp/include/llama.h" else (m, d))
    with pytest.raises(UserError, match="files of the manifest are missing"):
        packs.unpack(missing, "master")
    truncated = tmp_path / "truncated.tar.gz"
    truncated.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(UserError, match="is unreadable"):
        packs.unpack(truncated, "master")


def test_a_patched_archive_of_another_series_is_built_only_when_asked(master_archive, tmp_path, monkeypatch):
    # the series before a change, benchmarked against this one: refused by default, so a stale archive is never
    # taken for this checkout's; accepted with other_series, keyed by its own patch inputs
    monkeypatch.setenv("PYLLAMA_MOE_HOME", str(tmp_path / "home"))
    archive, _ = master_archive
    other = tmp_path / "other-series.tar.gz"

    def change(member, data):
        if member.name == packs.MANIFEST:
            manifest = json.loads(data)
            manifest.update(variant="patched", patch_inputs="another-series")
            data = json.dumps(manifest).encode()
        return member, data

    _rewrite(archive, other, change)
    with pytest.raises(UserError, match="other patches or native/ files"):
        packs.unpack(other, "patched")
    tree = packs.unpack(other, "patched", other_series=True)
    assert tree.inputs == "another-series"


def test_without_the_sdist_an_unpacked_archive_stands_in_for_it(master_archive, tmp_path, monkeypatch):
    # a machine with no package registry: once `build --archive` unpacked this pin's tree, `run`, `info` and
    # use_build find the build by the same key instead of trying to download the sdist
    from pyllama_moe.build import builder as build_mod
    from pyllama_moe.source import sdist as source

    monkeypatch.setenv("PYLLAMA_MOE_HOME", str(tmp_path / "home"))
    archive, _ = master_archive
    assert not source.sdist_cached() and packs.unpacked_source("master") is None
    tree = packs.unpack(archive, "master")
    offline = packs.unpacked_source("master")
    assert offline is not None and offline.llama_dir == tree.path and offline.python_dir is not None
    assert packs.unpacked_python_source().python_dir == offline.python_dir
    assert packs.unpacked_source("patched") is None  # a master tree never stands in for the patched one

    def no_download(*a, **kw):
        raise AssertionError("tried to fetch the sdist")

    monkeypatch.setattr(source, "fetch_sdist", no_download)
    with pytest.raises(UserError, match="pyllama-moe build --variant master"):
        build_mod.resolve("master", "cpu", make=False)
    key_offline = build_mod.build_key(build_mod.BuildSpec(tree))[0]
    assert key_offline == build_mod.build_key(build_mod.BuildSpec(
        packs.trees.Tree("master", offline.llama_dir, packs.trees.source_id(offline), "")))[0]
