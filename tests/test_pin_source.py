import hashlib
import io
import tarfile
from dataclasses import replace

import pytest

from pyllama_moe.errors import UserError
from pyllama_moe.source import sdist as source
from pyllama_moe.source.pin import load_pin


def _fake_sdist(tmp_path, files: dict[str, bytes]):
    pin = load_pin()
    path = tmp_path / pin.filename
    prefix = pin.filename.removesuffix(".tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        for rel, data in files.items():
            info = tarfile.TarInfo(f"{prefix}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path, replace(pin, sha256=hashlib.sha256(path.read_bytes()).hexdigest())


def test_pin_records_the_sdist_and_commit():
    pin = load_pin()
    assert pin.version == "0.3.36"
    assert pin.sha256 == "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
    assert pin.commit_full.startswith(pin.commit) and pin.commit == "0c1e57098"


def test_wrong_sdist_hash_is_refused_before_unpacking(tmp_path):
    bogus = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    bogus.write_bytes(b"not the sdist")
    with pytest.raises(UserError, match="sha256 .* the pin .* expects"):
        source.fetch_sdist(load_pin(), bogus)


def test_missing_sdist_path_names_it(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        source.fetch_sdist(load_pin(), tmp_path / "nope.tar.gz")


def test_unpack_takes_llama_cpp_and_the_python_package_and_records_hashes(tmp_path):
    data = b"int main() {}\n"
    sdist, pin = _fake_sdist(tmp_path, {
        "vendor/llama.cpp/src/a.cpp": data,
        "vendor/llama.cpp/.git": b"gitdir: ../../.git/modules/vendor/llama.cpp\n",
        "llama_cpp/__init__.py": b"",
        "README.md": b"ignored",
    })
    dest = tmp_path / "out"
    manifest = source._unpack(sdist, pin, dest)
    assert manifest == {"src/a.cpp": hashlib.sha256(data).hexdigest()}
    assert (dest / "llama.cpp/src/a.cpp").read_bytes() == data
    assert not (dest / "llama.cpp/.git").exists()  # a dangling submodule pointer would confuse git
    assert (dest / "python/llama_cpp/__init__.py").is_file()
    assert not (dest / "README.md").exists()


def test_real_source_is_verified_and_complete(src):
    assert (src.llama_dir / "ggml/src/ggml-backend.cpp").is_file()
    assert (src.python_dir / "llama_cpp/llama_cpp.py").is_file()
    # the manifest holds the sdist's own hashes, so a modified unpacked file is detectable
    rel = "include/llama.h"
    assert src.manifest[rel] == source.sha256_file(src.llama_dir / rel)


def test_llama_src_must_be_a_llama_cpp_tree(tmp_path):
    with pytest.raises(UserError, match="is not a llama.cpp source tree"):
        source.ensure_source(llama_src=tmp_path)
