"""Synthetic models, tokenizer, corpus and routing histogram.

The llama.cpp tests load the written files with the real library (the project's master CPU build, through the
sdist's llama-cpp-python ctypes bindings, in a child process).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize

from pyllama_moe.cli import synth as cli
from pyllama_moe.errors import UserError
from pyllama_moe.paths import PROJECT_ROOT
from pyllama_moe.synth.corpus import corpus_from_model, generate_corpus, vocab_words
from pyllama_moe.synth.gguf_read import read_gguf
from pyllama_moe.synth.lora import write_lora
from pyllama_moe.synth.probe import run_probe
from pyllama_moe.synth.quant import TensorSpec, chunk
from pyllama_moe.synth.routes import route_histogram
from pyllama_moe.synth.shapes import resolve_shape
from pyllama_moe.synth.tokenizer import SPACE, build_vocab
from pyllama_moe.synth.writer import write_model

@pytest.fixture(scope="session")
def llama(master_build, src) -> tuple[Path, Path]:
    """(folder with libllama, folder containing the llama_cpp package) of the project's master CPU build."""
    return master_build.bin_dir, src.python_dir


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """The tiny preset for both architectures and both weight types."""
    d = tmp_path_factory.mktemp("models")
    out = {}
    for arch in ("qwen3moe", "glm4moe"):
        for qtype in ("q4_0", "q8_0"):
            out[arch, qtype] = write_model(d / f"{arch}-{qtype}.gguf", resolve_shape("tiny", arch), qtype,
                                           progress=False).path
    return out


# --- tokenizer -------------------------------------------------------------------------------------------

def test_vocab_layout_and_prefix_closure():
    v = build_vocab(4096, seed=0)
    assert len(v) == 4096 and len(set(v.tokens)) == 4096
    assert v.tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert v.tokens[3] == "<0x00>" and v.tokens[258] == "<0xFF>"
    words = [t for t in v.tokens if t.startswith(SPACE) and len(t) > 1]
    assert len(words) == v.n_words > 3000
    present = set(v.tokens)
    # every prefix of every word is a token: llama.cpp's SPM merges can always build the whole word
    assert all(w[:i] in present for w in words for i in range(2, len(w)))
    # most frequent first: scores strictly decrease along the word list
    word_scores = v.scores[-v.n_words:]
    assert all(a > b for a, b in zip(word_scores, word_scores[1:]))
    assert build_vocab(4096, seed=0) == v and build_vocab(4096, seed=1) != v


# --- random quantized blocks -----------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q8_0], ids=["q4_0", "q8_0"])
def test_random_blocks_have_the_intended_statistics(qtype):
    spec = TensorSpec("blk.0.ffn_up_exps.weight", (4, 96, 256), qtype, std=0.02, in0=0.0, zero_out0=True)
    data = np.concatenate([chunk(spec, 7, i) for i in range(spec.n_chunks)])
    assert data.nbytes == spec.nbytes
    w = dequantize(data.reshape(4, 96, -1), qtype)
    assert w.shape == (4, 96, 256)
    assert np.isfinite(w).all()
    body = w[:, 1:, 1:]
    assert abs(body.std() - 0.02) < 0.001 and abs(body.mean()) < 0.0005
    assert (w[:, :, 0] == 0).all(), "element 0 of every row must be zero (the massive coordinate)"
    assert (w[:, 0, :] == 0).all(), "row 0 of every matrix must be zero"
    assert (chunk(spec, 7, 0) == chunk(spec, 7, 0)).all() and not (chunk(spec, 8, 0) == chunk(spec, 7, 0)).all()


# --- writer ----------------------------------------------------------------------------------------------

def test_written_file_matches_what_llama_cpp_expects(models):
    info = read_gguf(models["glm4moe", "q4_0"])
    assert info.arch == "glm4moe" and info.kv["tokenizer.ggml.model"] == "llama"
    assert info.arch_key("expert_count") == 16 and info.arch_key("expert_used_count") == 4
    assert info.arch_key("leading_dense_block_count") == 1 and info.arch_key("expert_shared_count") == 1
    t = info.tensors
    assert "blk.0.ffn_gate.weight" in t and "blk.0.ffn_gate_inp.weight" not in t  # dense leading layer
    for name in ("ffn_gate_inp.weight", "exp_probs_b.bias", "ffn_up_exps.weight", "ffn_down_shexp.weight",
                 "post_attention_norm.weight", "attn_q.bias"):
        assert f"blk.1.{name}" in t, name
    assert t["blk.1.ffn_up_exps.weight"].shape == (256, 128, 16) and t["blk.1.ffn_up_exps.weight"].qtype == QT.Q4_0
    assert t["blk.1.ffn_down_exps.weight"].shape == (128, 256, 16)
    assert t["blk.1.ffn_gate_inp.weight"].qtype == QT.F32 and t["blk.1.attn_norm.weight"].qtype == QT.F32
    last = max(t.values(), key=lambda x: x.offset)
    assert info.data_offset + last.offset + last.nbytes == info.file_size

    q = read_gguf(models["qwen3moe", "q8_0"])
    assert "blk.0.ffn_gate_inp.weight" in q.tensors and "blk.0.attn_q_norm.weight" in q.tensors
    assert not any("shexp" in n or "exp_probs_b" in n for n in q.tensors)
    assert q.tensors["blk.3.attn_q.weight"].qtype == QT.Q8_0


def _plain(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


def test_header_reader_agrees_with_the_gguf_package(models):
    # read_gguf parses headers itself (GGUFReader takes seconds on a real vocabulary: see its docstring); the
    # field's reader checks that it finds the same keys, values, tensors, types and offsets
    for path in models.values():
        ours, theirs = read_gguf(path), GGUFReader(path)
        assert ours.data_offset == theirs.data_offset
        assert {t.name: (t.shape, t.qtype, ours.data_offset + t.offset, t.nbytes) for t in ours.tensors.values()} == \
            {t.name: (tuple(t.shape.tolist()), t.tensor_type, t.data_offset, t.n_bytes) for t in theirs.tensors}
        fields = {key: f.contents() for key, f in theirs.fields.items() if not key.startswith("GGUF.")}
        assert {key: _plain(value) for key, value in ours.kv.items()} == fields


def test_writer_is_deterministic(tmp_path):
    shape = resolve_shape("tiny", layers=2, vocab=1024)
    a = write_model(tmp_path / "a.gguf", shape, "q4_0", seed=3, threads=1, progress=False).path
    b = write_model(tmp_path / "b.gguf", shape, "q4_0", seed=3, threads=3, progress=False).path
    c = write_model(tmp_path / "c.gguf", shape, "q4_0", seed=4, progress=False).path
    assert _sha(a) == _sha(b), "same seed must give the same bytes, whatever the thread count"
    assert _sha(a) != _sha(c)
    assert not list(tmp_path.glob("*.partial"))


# --- llama.cpp -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3moe", "glm4moe"])
@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_llama_cpp_loads_the_model_and_routes_across_experts(models, arch, qtype, llama):
    LIB_DIR, PKG = llama
    r = route_histogram(models[arch, qtype], LIB_DIR, PKG, n_tokens=128, threads=1)
    assert r["logits"]["finite"] and r["logits"]["std"] > 0.1
    moe_layers = [1, 2, 3] if arch == "glm4moe" else [0, 1, 2, 3]
    assert [L["layer"] for L in r["layers"]] == moe_layers
    for L in r["layers"]:
        assert sum(L["counts"]) == 128 * 4
        assert L["used"] >= 14 and L["top10_share"] < 0.25, L  # skew 0: no collapse onto a few experts


@pytest.mark.parametrize("arch", ["qwen3moe", "glm4moe"])
def test_deep_model_keeps_routing_spread_and_token_identity(tmp_path, arch, llama):
    LIB_DIR, PKG = llama
    """48 layers: no drift toward a few experts in deep layers, and the token embedding stays visible."""
    shape = resolve_shape("tiny", arch, layers=48, experts=32, expert_ff=32, vocab=1024)
    r = route_histogram(write_model(tmp_path / "deep.gguf", shape, progress=False).path, LIB_DIR, PKG,
                        n_tokens=256, threads=1)
    assert r["logits"]["finite"] and len(r["layers"]) == (48 if arch == "qwen3moe" else 47)
    s = r["summary"]
    # uniform routing gives ~0.17 here (4 of 32 experts, 1024 selections); a shared direction leaking into
    # the layers pushes deep layers to ~0.25-0.3
    assert s["min_used"] == 32 and s["mean_top10_share"] < 0.195 and s["max_top10_share"] < 0.23, s
    stream = r["layers"][-1]["stream"]
    assert 0.5 < stream["cos_first"] < 0.95, stream  # layers add to the embedding without drowning it


def test_skew_makes_a_few_experts_popular(tmp_path, llama):
    LIB_DIR, PKG = llama
    shape = resolve_shape("tiny", experts=32)
    flat = write_model(tmp_path / "flat.gguf", shape, skew=0.0, progress=False).path
    skewed = write_model(tmp_path / "skewed.gguf", shape, skew=1.0, progress=False).path
    a = route_histogram(flat, LIB_DIR, PKG, n_tokens=256, threads=1)
    b = route_histogram(skewed, LIB_DIR, PKG, n_tokens=256, threads=1)
    assert b["logits"]["finite"]
    assert a["summary"]["max_top10_share"] < 0.25
    assert b["summary"]["min_top10_share"] > a["summary"]["max_top10_share"] + 0.1


def test_corpus_round_trips_through_llama_cpp_tokenizer(models, tmp_path, llama):
    LIB_DIR, PKG = llama
    model = models["qwen3moe", "q4_0"]
    text = corpus_from_model(model, n_tokens=5000, seed=1)
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    r = run_probe("roundtrip", model, LIB_DIR, PKG, text_file=str(tmp_path / "c.txt"))
    assert r["pieces_equal"], r["context"]
    assert r["detokenize_equal"]
    assert 4500 <= r["n_tokens"] <= 5500, r
    # whole words: at most one token per word plus punctuation/newlines, and byte fallback only for "\n"
    assert r["byte_tokens"] == text.count("\n")
    assert r["n_tokens"] <= r["n_words"] * 1.35


# --- corpus ----------------------------------------------------------------------------------------------

def test_corpus_is_deterministic_and_uses_the_vocabulary(models):
    info = read_gguf(models["qwen3moe", "q4_0"])
    words = vocab_words(info)
    assert len(words) > 3000
    a = generate_corpus(words, 2000, seed=5)
    assert a == generate_corpus(words, 2000, seed=5) != generate_corpus(words, 2000, seed=6)
    vocab = set(words)
    used = [w.strip(",.?!") for w in a.split()]
    assert all(w in vocab for w in used)
    # Zipf: the most frequent word is far more common than the median one
    counts = np.unique(used, return_counts=True)[1]
    assert counts.max() > 20 * np.median(counts)


# --- bad input -------------------------------------------------------------------------------------------

def _truncated(src: Path, dst: Path, n: int) -> Path:
    dst.write_bytes(src.read_bytes()[:n])
    return dst


def test_bad_inputs_raise_user_errors(models, tmp_path, llama):
    LIB_DIR, PKG = llama
    good = models["qwen3moe", "q4_0"]
    cut_data = _truncated(good, tmp_path / "cut.gguf", good.stat().st_size // 2)
    cut_header = _truncated(good, tmp_path / "head.gguf", 500)
    (tmp_path / "text.gguf").write_text("not a model")
    for bad in (tmp_path / "missing.gguf", cut_data, cut_header, tmp_path / "text.gguf", tmp_path):
        with pytest.raises(UserError) as e:
            route_histogram(bad, LIB_DIR, PKG)
        assert str(bad) in str(e.value)
    for bad in (tmp_path / "missing.gguf", cut_header, tmp_path / "text.gguf"):
        with pytest.raises(UserError):
            corpus_from_model(bad)
    with pytest.raises(UserError, match="unknown preset 'nope'"):
        resolve_shape("nope")
    with pytest.raises(UserError):
        resolve_shape("tiny", experts_used=32)
    with pytest.raises(UserError, match="no libllama"):
        route_histogram(good, tmp_path, PKG)
    with pytest.raises(UserError, match="no llama_cpp package"):
        route_histogram(good, LIB_DIR, tmp_path)


@pytest.mark.parametrize("kind", ["missing", "header cut", "data cut", "foreign"])
def test_cli_refuses_a_bad_model_file_in_one_line(models, tmp_path, kind):
    good, bad = models["qwen3moe", "q4_0"], tmp_path / "bad.gguf"
    info, cut_at = read_gguf(good), good.stat().st_size // 2
    cut = next(t for t in info.tensors.values() if info.data_offset + t.offset + t.nbytes > cut_at)
    if kind == "header cut":
        _truncated(good, bad, 500)
    elif kind == "data cut":
        _truncated(good, bad, cut_at)
    elif kind == "foreign":
        bad.write_text("not a model\n" * 20)
    redo = "re-create or re-download it"
    expected = {
        "missing": f"{bad} does not exist (the model to read)",
        "header cut": f"{bad} is not a valid GGUF file (ends at byte 500 inside the header): {redo} "
                      "(a truncated or interrupted write looks like this)",
        "data cut": f"{bad} is truncated: tensor {cut.name} ends at byte "
                    f"{info.data_offset + cut.offset + cut.nbytes} but the file has {cut_at}: {redo}",
        "foreign": f"{bad} is not a valid GGUF file (wrong magic: not a GGUF file): {redo} "
                   "(a truncated or interrupted write looks like this)",
    }[kind]
    # routes reads the header before it looks for llama.cpp: the refusal needs no build
    proc = subprocess.run([sys.executable, "-m", "pyllama_moe", "routes", str(bad), "--lib", str(tmp_path),
                           "--llama-cpp-pkg", str(tmp_path)], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    # one line, no traceback, naming the argument: the header is read while the arguments are
    assert proc.stderr.splitlines() == [f"pyllama-moe routes: error: argument model: {expected}"]


# --- CLI -------------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pyllama-moe")
    cli.register(p.add_subparsers(dest="verb", required=True))
    return p


def _run(*argv: str) -> int:
    args = _parser().parse_args(list(argv))
    return args.func(args)


def test_cli_synth_and_corpus(tmp_path, capsys, llama):
    LIB_DIR, PKG = llama
    model = tmp_path / "m.gguf"
    assert _run("synth", "--preset", "tiny", "--arch", "glm4moe", "--type", "q8_0", "--layers", "3",
                "--skew", "0.5", "--seed", "2", "--quiet", "-o", str(model)) == 0
    info = read_gguf(model)
    assert info.arch == "glm4moe" and info.arch_key("block_count") == 3
    assert info.tensors["blk.2.ffn_up_exps.weight"].qtype == QT.Q8_0
    mixed = tmp_path / "mixed.gguf"
    assert _run("synth", "--preset", "tiny", "--type", "q8_0", "--down-type", "q4_0", "--quiet", "-o", str(mixed)) == 0
    mixed_types = {name: t.qtype for name, t in read_gguf(mixed).tensors.items() if name.startswith("blk.1.")}
    assert mixed_types["blk.1.ffn_down_exps.weight"] == QT.Q4_0
    assert {mixed_types[f"blk.1.{n}.weight"] for n in ("ffn_gate_exps", "ffn_up_exps", "attn_q")} == {QT.Q8_0}
    assert _run("corpus", "--model", str(model), "--tokens", "300", "-o", str(tmp_path / "c.txt")) == 0
    assert len((tmp_path / "c.txt").read_text().split()) > 150
    capsys.readouterr()
    none = str(tmp_path / "none.gguf")
    # refused while the arguments are read, before any build (tests/test_cli_errors.py runs every verb's)
    for argv, said in ((("synth", "--preset", "huge", "-o", str(tmp_path / "x.gguf")), "invalid choice: 'huge'"),
                       (("synth", "--down-type", "q6_k", "-o", str(tmp_path / "x.gguf")), "invalid choice: 'q6_k'"),
                       (("corpus", "--model", none), "does not exist"),
                       (("routes", none, "--lib", str(LIB_DIR), "--llama-cpp-pkg", str(PKG)), "does not exist"),
                       (("routes", none), "does not exist")):  # with the default library and package
        with pytest.raises(SystemExit) as exc:
            _run(*argv)
        assert exc.value.code == 2 and said in capsys.readouterr().err


def test_cli_routes_json(models, capsys, llama):
    LIB_DIR, PKG = llama
    import json

    assert _run("routes", str(models["qwen3moe", "q4_0"]), "--lib", str(LIB_DIR), "--llama-cpp-pkg", str(PKG),
                "--tokens", "64", "--threads", "1", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_expert"] == 16 and len(out["layers"]) == 4 and out["logits"]["finite"]
    assert _run("routes", str(models["qwen3moe", "q4_0"]), "--lib", str(LIB_DIR), "--llama-cpp-pkg", str(PKG),
                "--tokens", "64", "--threads", "1") == 0
    table = capsys.readouterr().out
    assert "top10%" in table and ("16/16" in table or "15/16" in table)


# --- LoRA adapter (llama.cpp loads it in test_server_soak.py) --------------------------------------------

def test_lora_pairs_match_the_models_weights_and_leave_the_massive_coordinate_alone(tmp_path):
    model = write_model(tmp_path / "m.gguf", resolve_shape("tiny"), "q8_0", progress=False).path
    r = write_lora(tmp_path / "lora.gguf", model, rank=4, seed=3)
    info, base = read_gguf(r.path), read_gguf(model, check_data=False)
    assert info.kv["general.type"] == "adapter" and info.kv["adapter.type"] == "lora"
    assert info.arch == "qwen3moe" and info.kv["adapter.lora.alpha"] == 4.0
    assert r.n_pairs == 8 and len(info.tensors) == 16
    for name in ("blk.0.attn_q.weight", "blk.3.attn_v.weight"):
        n_in, n_out = base.tensors[name].shape
        assert info.tensors[name + ".lora_a"].shape == (n_in, 4)  # ggml order, as llama-adapter.cpp checks
        assert info.tensors[name + ".lora_b"].shape == (4, n_out)
    data = {t.name: np.asarray(t.data) for t in GGUFReader(r.path).tensors}
    a, b = data["blk.0.attn_q.weight.lora_a"], data["blk.0.attn_q.weight.lora_b"]
    assert a.shape == (4, 256) and not a[:, 0].any() and a[:, 1:].all() and b.all()
    with pytest.raises(UserError, match="wider than a weight"):
        write_lora(tmp_path / "wide.gguf", model, rank=4096)
