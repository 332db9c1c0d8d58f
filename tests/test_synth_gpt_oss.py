"""The gpt-oss synthetic model: a MoE with per-expert biases (llama.cpp's openai-moe architecture).

What llama.cpp requires of it is read from the pinned source (src/models/openai-moe.cpp: load_arch_hparams,
load_arch_tensors); the file is checked against that list without llama.cpp, then loaded with the project's
master CPU build, where zeroing any one kind of expert bias must change the logits.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from pyllama_moe.errors import UserError
from pyllama_moe.harness.runner import RunSpec, run
from pyllama_moe.synth.gguf_read import read_gguf
from pyllama_moe.synth.routes import route_histogram
from pyllama_moe.synth.shapes import resolve_shape
from pyllama_moe.synth.writer import write_model

# load_arch_tensors of the pinned openai-moe.cpp: every tensor it creates with flags 0 (required); the q/k/v
# biases are optional there, and written because gpt-oss has them
REQUIRED_LAYER_TENSORS = (
    "attn_norm.weight", "post_attention_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
    "attn_output.weight", "attn_output.bias", "attn_sinks.weight", "ffn_gate_inp.weight", "ffn_gate_inp.bias",
    "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
    "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias",
)
# keys read with get_key(..., required) by load_hparams and openai-moe's load_arch_hparams
REQUIRED_KEYS = ("context_length", "embedding_length", "block_count", "attention.layer_norm_rms_epsilon",
                 "expert_feed_forward_length", "attention.sliding_window")
EXPERT_BIASES = ("ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gpt-oss")
    return write_model(d / "gpt-oss.gguf", resolve_shape("gpt-oss-tiny"), "q8_0", seed=3, progress=False).path


def _tensors(reader: GGUFReader) -> dict:
    """The file's tensors by name, their data mapped (numpy shapes: ggml's ne reversed)."""
    return {t.name: t for t in reader.tensors}


def _f32(tensors: dict, name: str) -> np.ndarray:
    assert tensors[name].tensor_type == QT.F32, name
    return tensors[name].data


def _zeroed(src: Path, dst: Path, names: list[str]) -> Path:
    """A copy of `src` with the data of the named tensors set to zero (names=[]: an identical copy)."""
    shutil.copyfile(src, dst)
    reader = GGUFReader(dst, "r+")
    tensors = _tensors(reader)
    for name in names:
        tensors[name].data[...] = 0
    reader.data.flush()
    return dst


def test_file_has_every_key_and_tensor_llama_cpp_requires(model):
    info = read_gguf(model)
    assert info.arch == "gpt-oss" and info.kv["tokenizer.ggml.model"] == "llama"
    for key in REQUIRED_KEYS:
        assert info.arch_key(key) is not None, key
    assert info.arch_key("attention.sliding_window") == 128 and info.arch_key("expert_feed_forward_length") == 128
    assert info.arch_key("expert_count") == 16 and info.arch_key("expert_used_count") == 4
    assert info.arch_key("attention.head_count") == 8 and info.arch_key("attention.key_length") == 64
    t = info.tensors
    for il in range(4):
        for name in REQUIRED_LAYER_TENSORS:
            assert f"blk.{il}.{name}" in t, f"blk.{il}.{name}"
    assert not any("q_norm" in n or "shexp" in n for n in t)
    # ggml order: {n_embd, n_ff_exp, n_expert} weights, {n_ff_exp, n_expert} / {n_embd, n_expert} biases
    assert t["blk.0.ffn_up_exps.weight"].shape == (256, 128, 16) and t["blk.0.ffn_up_exps.weight"].qtype == QT.Q8_0
    assert t["blk.0.ffn_down_exps.weight"].shape == (128, 256, 16)
    assert t["blk.0.ffn_gate_exps.bias"].shape == t["blk.0.ffn_up_exps.bias"].shape == (128, 16)
    assert t["blk.0.ffn_down_exps.bias"].shape == (256, 16)
    assert t["blk.0.attn_sinks.weight"].shape == (8,) and t["blk.0.attn_q.weight"].shape == (256, 512)
    assert t["blk.0.attn_output.weight"].shape == (512, 256) and t["blk.0.ffn_gate_inp.bias"].shape == (16,)


def test_expert_biases_are_random_per_expert_and_leave_the_massive_coordinate(model):
    tensors = _tensors(GGUFReader(model))
    for il in range(4):
        for name in EXPERT_BIASES:
            b = _f32(tensors, f"blk.{il}.{name}")  # (n_expert, width)
            assert np.isfinite(b).all() and b[:, 1:].std() > 0.1, name
            assert len({row.tobytes() for row in b}) == 16, f"{name}: every expert has a bias of its own"
        assert (_f32(tensors, f"blk.{il}.ffn_down_exps.bias")[:, 0] == 0).all()
        assert (_f32(tensors, f"blk.{il}.attn_output.bias") == 0).all()
        assert _f32(tensors, f"blk.{il}.attn_sinks.weight").std() > 0.3


def test_shape_checks():
    switched = resolve_shape("tiny", "gpt-oss")
    assert switched.n_swa == 128 and switched.n_shared == switched.n_dense_lead == 0
    assert resolve_shape("gpt-oss-tiny", "qwen3moe").n_swa == 0
    assert resolve_shape("gpt-oss-tiny", sliding_window=32).n_swa == 32
    with pytest.raises(UserError, match="sliding window"):
        resolve_shape("gpt-oss-tiny", sliding_window=0)
    with pytest.raises(UserError, match="sliding window"):
        resolve_shape("tiny", sliding_window=64)
    with pytest.raises(UserError, match="no shared experts"):
        resolve_shape("gpt-oss-tiny", shared_experts=1)


def test_llama_cpp_loads_it_and_routes_across_experts(model, master_build, src):
    r = route_histogram(model, master_build.bin_dir, src.python_dir, n_tokens=256, threads=1)
    assert r["arch"] == "gpt-oss" and r["logits"]["finite"] and r["logits"]["std"] > 0.1
    assert [L["layer"] for L in r["layers"]] == [0, 1, 2, 3]
    for L in r["layers"]:
        assert sum(L["counts"]) == 256 * 4
        assert L["used"] >= 14 and L["top10_share"] < 0.25, L  # the biases do not make a few experts popular


def test_zeroing_any_expert_bias_changes_the_logits(model, master_build, src, tmp_path):
    """Experts on the host as in the identity cells; 200 tokens, past the 128-token sliding window."""
    tokens = [int(t) for t in np.random.default_rng(0).integers(300, 4096, 200)]

    def logits(path: Path) -> np.ndarray:
        out = run(master_build, src, RunSpec(path, tokens=tokens, cpu_moe=True, n_ubatch=64, threads=2)).logits
        assert out.shape == (200, 4096) and np.isfinite(out).all()
        return out

    base = logits(model)
    # the control: a copy with nothing zeroed computes the same bytes, so a difference below is the biases'
    assert np.array_equal(logits(_zeroed(model, tmp_path / "copy.gguf", [])), base)
    for name in EXPERT_BIASES:
        zeroed = _zeroed(model, tmp_path / f"no-{name}.gguf", [f"blk.{il}.{name}" for il in range(4)])
        diff = np.abs(logits(zeroed) - base)
        assert diff.max() > 0.05 and diff[0].max() > 0, f"zeroing {name} left the logits (nearly) unchanged"
