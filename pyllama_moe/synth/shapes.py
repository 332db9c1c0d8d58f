"""Model shapes: named presets plus command-line overrides, checked against what llama.cpp will accept."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pyllama_moe.errors import UserError
from pyllama_moe.synth.tokenizer import MIN_VOCAB

ARCHS = ("qwen3moe", "glm4moe", "gpt-oss")
# the sliding window a preset of another architecture gets when switched to gpt-oss (gpt-oss's own is 128)
GPT_OSS_SWA = 128


@dataclass(frozen=True)
class ModelShape:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    expert_ff: int  # width of one routed expert (and of each shared expert)
    n_ff: int  # width of a dense FFN (glm4moe's leading dense layers); also written as feed_forward_length
    n_vocab: int
    n_ctx: int = 32768
    n_shared: int = 0  # shared experts per MoE layer (glm4moe)
    n_dense_lead: int = 0  # leading dense (non-MoE) layers (glm4moe)
    n_swa: int = 0  # sliding-window width of every other layer, from layer 0 (gpt-oss; 0: no sliding window)
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6

    @property
    def moe_layers(self) -> range:
        return range(self.n_dense_lead, self.n_layer)

    def n_params(self) -> int:
        """Weights in the file (excluding norms and biases, which are negligible)."""
        attn = self.n_embd * self.head_dim * (2 * self.n_head + 2 * self.n_head_kv)
        moe = self.n_expert * 3 * self.n_embd * self.expert_ff + self.n_embd * self.n_expert
        moe += self.n_shared * 3 * self.n_embd * self.expert_ff
        dense = 3 * self.n_embd * self.n_ff
        n_moe = len(self.moe_layers)
        return (self.n_layer * attn + n_moe * moe + self.n_dense_lead * dense
                + 2 * self.n_vocab * self.n_embd)


# Presets. Vocabularies are the synthetic tokenizer's ~32k (real Qwen3/GLM vocabs are ~150k: pass --vocab
# to match them when the embedding/output size matters).
PRESETS: dict[str, dict] = {
    # a few MB, for tests
    "tiny": dict(arch="qwen3moe", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=16,
                 n_expert_used=4, expert_ff=128, n_ff=512, n_vocab=4096, n_ctx=4096),
    # ~95 MB at Q4_0
    "small": dict(arch="qwen3moe", n_layer=6, n_embd=512, n_head=8, n_head_kv=2, head_dim=64, n_expert=32,
                  n_expert_used=4, expert_ff=256, n_ff=1024, n_vocab=32000, n_ctx=8192),
    # Qwen3-30B-A3B's shape: ~16 GB at Q4_0
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                          n_expert=128, n_expert_used=8, expert_ff=768, n_ff=6144, n_vocab=32000, n_ctx=40960),
    # GLM-4.5-Air's shape: one dense layer, one shared expert; ~60 GB at Q4_0
    "glm-4.5-air": dict(arch="glm4moe", n_layer=46, n_embd=4096, n_head=96, n_head_kv=8, head_dim=128,
                        n_expert=128, n_expert_used=8, expert_ff=1408, n_ff=10944, n_vocab=32000,
                        n_ctx=131072, n_shared=1, n_dense_lead=1, rms_eps=1e-5),
    # gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE): per-expert biases on the gate, up and down matrices, a router
    # bias, attention sinks, a sliding window on every other layer. Tiny like "tiny", but with q/k/v widths
    # other than the embedding (8 heads x 64 = 512 against 256), as gpt-oss-20b has (64 x 64 against 2880).
    "gpt-oss-tiny": dict(arch="gpt-oss", n_layer=4, n_embd=256, n_head=8, n_head_kv=2, head_dim=64, n_expert=16,
                         n_expert_used=4, expert_ff=128, n_ff=128, n_vocab=4096, n_ctx=4096, n_swa=GPT_OSS_SWA,
                         rope_base=150_000.0, rms_eps=1e-5),
    # gpt-oss-20b's shape (without its YaRN context extension and o200k vocabulary): ~21 GB at Q8_0, ~11 GB at Q4_0
    "gpt-oss-20b": dict(arch="gpt-oss", n_layer=24, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64, n_expert=32,
                        n_expert_used=4, expert_ff=2880, n_ff=2880, n_vocab=32000, n_ctx=131072, n_swa=GPT_OSS_SWA,
                        rope_base=150_000.0, rms_eps=1e-5),
}

# command-line override name -> ModelShape field
OVERRIDES = {
    "layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "kv_heads": "n_head_kv", "head_dim": "head_dim",
    "experts": "n_expert", "experts_used": "n_expert_used", "expert_ff": "expert_ff", "ff": "n_ff",
    "vocab": "n_vocab", "ctx": "n_ctx", "shared_experts": "n_shared", "dense_layers": "n_dense_lead",
    "sliding_window": "n_swa",
}


def resolve_shape(preset: str, arch: str | None = None, **overrides: int | None) -> ModelShape:
    """The preset's shape with the given architecture and overrides (None means keep the preset's)."""
    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}", f"use one of: {', '.join(PRESETS)}")
    fields = dict(PRESETS[preset])
    if arch is not None:
        if arch not in ARCHS:
            raise UserError(f"unknown architecture {arch!r}", f"use one of: {', '.join(ARCHS)}")
        if arch != fields["arch"]:
            fields["arch"] = arch
            # a preset made for another architecture: give glm4moe its shared expert and dense layer and
            # gpt-oss its sliding window by default, and take away what the others do not have
            fields["n_shared"], fields["n_dense_lead"] = (1, 1) if arch == "glm4moe" else (0, 0)
            fields["n_swa"] = GPT_OSS_SWA if arch == "gpt-oss" else 0
    for key, value in overrides.items():
        if key not in OVERRIDES:
            raise TypeError(f"unknown override {key!r}")
        if value is not None:
            fields[OVERRIDES[key]] = value
    shape = ModelShape(**fields)
    check_shape(shape)
    return shape


def check_shape(s: ModelShape) -> None:
    def bad(what: str, fix: str) -> None:
        raise UserError(what, fix)

    for f in dataclasses.fields(s):
        v = getattr(s, f.name)
        if isinstance(v, int) and f.name not in ("n_shared", "n_dense_lead", "n_swa") and v <= 0:
            bad(f"{f.name} = {v}", "every size must be a positive integer")
    # Q4_0/Q8_0 blocks are 32 values along each row: every matrix's input width must be a multiple of 32.
    for name, v in (("hidden", s.n_embd), ("expert ff", s.expert_ff), ("ff", s.n_ff),
                    ("heads x head dim", s.n_head * s.head_dim)):
        if v % 32:
            bad(f"{name} = {v} is not a multiple of 32", "Q4_0/Q8_0 rows are made of 32-value blocks")
    if s.head_dim % (4 if s.arch == "glm4moe" else 2):
        bad(f"head dim {s.head_dim}", "RoPE needs an even number of rotated dimensions (glm4moe rotates half "
                                       "of each head, so there it must be a multiple of 4)")
    if s.n_head % s.n_head_kv:
        bad(f"{s.n_head} heads is not a multiple of {s.n_head_kv} kv heads", "pick kv heads that divide heads")
    if not 1 <= s.n_expert_used <= s.n_expert:
        bad(f"experts used {s.n_expert_used} with {s.n_expert} experts", "use 1 <= experts-used <= experts")
    if s.n_expert > 512:
        bad(f"{s.n_expert} experts", "llama.cpp supports at most 512 experts")
    if s.n_vocab < MIN_VOCAB:
        bad(f"vocab {s.n_vocab}", f"the synthetic tokenizer needs at least {MIN_VOCAB} tokens")
    if s.arch in ("qwen3moe", "gpt-oss") and (s.n_shared or s.n_dense_lead):
        bad(f"{s.arch} has no shared experts or dense layers", "drop --shared-experts/--dense-layers or use glm4moe")
    if s.arch == "gpt-oss" and s.n_swa < 1:
        bad(f"gpt-oss with sliding window {s.n_swa}", "llama.cpp requires gpt-oss's sliding window: give 1 or more")
    if s.arch != "gpt-oss" and s.n_swa:
        bad(f"{s.arch} with sliding window {s.n_swa}", "only gpt-oss has a sliding window here: drop --sliding-window")
    if s.arch == "glm4moe":
        if s.n_shared < 1 or s.n_dense_lead < 0:
            bad(f"glm4moe with {s.n_shared} shared experts and {s.n_dense_lead} dense layers",
                "glm4moe's graph needs at least one shared expert, and dense layers can't be negative")
        if s.n_dense_lead >= s.n_layer:
            bad(f"{s.n_dense_lead} dense layers of {s.n_layer}", "leave at least one MoE layer")
