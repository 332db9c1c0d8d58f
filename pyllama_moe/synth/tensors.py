"""Which tensors each architecture needs, and the weight statistics that make routing behave like a real model.

Random weights left to themselves make routing collapse onto a few experts in deep layers, so every scale here
keeps the residual stream token-dependent, and the only shared component (coordinate 0, a "massive activation")
is read by the routers alone, where it sets the skew. The recipe, item by item: docs/synthetic-models.md,
"Weight statistics".
"""

from __future__ import annotations

import math
import zlib

import numpy as np
from gguf import GGMLQuantizationType as QT

from pyllama_moe.synth.quant import TensorSpec
from pyllama_moe.synth.shapes import ModelShape

EMBD_STD = 8.0  # per-coordinate std of the token embedding (large enough that small projections keep
#                 their f16 block scales well away from subnormals)
SWIGLU_RMS = 0.596  # RMS of silu(g) * u for g, u ~ N(0, 1)
ATTN_OUT_RMS = 0.8  # rough RMS of an attention head's output (a few V rows mixed) for V ~ N(0, 1)
QK_GAIN = 2.0  # q and k are scaled by this: attention logits of std ~4 make attention peaky, as in real
#                models, instead of an average over all positions that cancels out to nothing
ROUTER_LOGIT_STD = 1.0  # token-dependent spread of the router logits
PROBS_BIAS_STD = 0.001  # glm4moe's selection bias (exp_probs_b): tiny, so it doesn't skew on its own
EXPERT_BIAS_STD = 0.5  # gpt-oss's gate and up expert biases, relative to the N(0, 1) pre-activations
DOWN_BIAS_SHARE = 0.5  # gpt-oss: RMS of an expert's down bias relative to its whole output's
SINK_STD = 1.0  # gpt-oss's attention sinks (one logit per head)
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants


def massive_value(n_embd: int) -> float:
    # a quarter of the embedding's squared norm sits in coordinate 0
    return EMBD_STD * math.sqrt((n_embd - 1) / 3.0)


class _Stream:
    """The expected residual stream: its token-dependent part grows by `a` (in RMS, relative to the embedding)
    per sublayer; coordinate 0 stays at massive_value. Used to scale readers so their outputs are ~N(0, 1)."""

    def __init__(self, n: int, a: float):
        self.n, self.a, self.m = n, a, massive_value(n)

    def h_rand(self, sublayers_before: int) -> float:
        """Per-coordinate RMS of the token-dependent coordinates after RMSNorm."""
        rand = EMBD_STD * math.sqrt(1 + sublayers_before * self.a ** 2)
        rms = math.sqrt((self.m ** 2 + (self.n - 1) * rand ** 2) / self.n)
        return rand / rms

    def h0(self, sublayers_before: int) -> float:
        """Coordinate 0 after RMSNorm."""
        rand = EMBD_STD * math.sqrt(1 + sublayers_before * self.a ** 2)
        return self.m / math.sqrt((self.m ** 2 + (self.n - 1) * rand ** 2) / self.n)

    def read_std(self, sublayers_before: int) -> float:
        return 1.0 / (math.sqrt(self.n - 1) * self.h_rand(sublayers_before))


def gate_weight_rms(n_expert: int, k: int, sigmoid: bool) -> float:
    """sqrt(E[sum of squared expert weights]) for top-k routing with normalised weights and N(0,1) logits:
    how much a weighted sum of k independent expert outputs shrinks. A fixed-seed Monte Carlo estimate."""
    rng = np.random.default_rng(12345)
    logits = rng.standard_normal((4096, n_expert)) * ROUTER_LOGIT_STD
    top = np.sort(logits, axis=1)[:, -k:]
    p = 1 / (1 + np.exp(-top)) if sigmoid else np.exp(top - top[:, -1:])
    w = p / p.sum(axis=1, keepdims=True)
    return float(np.sqrt((w ** 2).sum(axis=1).mean()))


def swiglu_oai_rms(bias_std: float) -> float:
    """RMS of gpt-oss's activation (clamp(u, -L, L) + 1) * g' * sigmoid(alpha g'), g' = min(g, L), for g and u
    ~N(0, 1) plus a per-unit bias of std `bias_std` on each. A fixed-seed Monte Carlo estimate."""
    rng = np.random.default_rng(12345)
    g, u = (rng.standard_normal(1 << 18) + rng.standard_normal(1 << 18) * bias_std for _ in range(2))
    g = np.minimum(g, OAI_LIMIT)
    act = g / (1 + np.exp(-OAI_ALPHA * g)) * (np.clip(u, -OAI_LIMIT, OAI_LIMIT) + 1)
    return float(np.sqrt((act ** 2).mean()))


def plan(shape: ModelShape, qtype: QT, skew: float, seed: int, residual_scale: float = 0.1,
         down_qtype: QT | None = None) -> list[TensorSpec]:
    """Every tensor of the model, in file order; down_qtype: the routed experts' down matrices' type where it differs
    (llama-quantize's mixes keep them wider, so one layer's experts have two types)."""
    s, a = shape, residual_scale
    n = s.n_embd
    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    glm, oss = s.arch == "glm4moe", s.arch == "gpt-oss"
    stream = _Stream(n, a)

    def reader(name: str, rows: int, std: float, experts: int = 0) -> TensorSpec:
        shp = (experts, rows, n) if experts else (rows, n)
        return TensorSpec(name, shp, qtype, std=std, in0=0.0)

    def writer(name: str, width: int, std: float, experts: int = 0, qt: QT = qtype) -> TensorSpec:
        shp = (experts, n, width) if experts else (n, width)
        return TensorSpec(name, shp, qt, std=std, zero_out0=True)

    def const(name: str, size: int, value: float = 1.0) -> TensorSpec:
        return TensorSpec(name, (size,), QT.F32, values=lambda: np.full(size, value, np.float32))

    def small(name: str, size: int, std: float) -> TensorSpec:
        key = [seed, zlib.crc32(name.encode())]
        return TensorSpec(name, (size,), QT.F32, values=lambda: np.random.default_rng(key).normal(0, std, size))

    def expert_bias(name: str, width: int, std: float, zero0: bool = False) -> TensorSpec:
        # one row per expert; zero0: element 0 zero, so a bias on the stream leaves the massive coordinate alone
        def values() -> np.ndarray:
            v = np.random.default_rng([seed, zlib.crc32(name.encode())]).normal(0, std, (s.n_expert, width))
            if zero0:
                v[:, 0] = 0.0
            return v
        return TensorSpec(name, (s.n_expert, width), QT.F32, values=values)

    def down_std(width: int, share: float = 1.0, w_rms: float = 1.0, act_rms: float = SWIGLU_RMS) -> float:
        # a SwiGLU block's output adds `share * a` of the embedding's RMS to the stream
        return share * a * EMBD_STD / (act_rms * math.sqrt(width) * w_rms)

    specs = [TensorSpec("token_embd.weight", (s.n_vocab, n), QT.F16, std=EMBD_STD, in0=massive_value(n))]
    attn_out_std = a * EMBD_STD / (math.sqrt(q_dim) * ATTN_OUT_RMS)
    w_rms = gate_weight_rms(s.n_expert, s.n_expert_used, sigmoid=glm)
    # glm4moe splits the FFN perturbation between the routed and the shared experts; gpt-oss between an
    # expert's matrices and its down bias
    share = 1 / math.sqrt(2) if glm else math.sqrt(1 - DOWN_BIAS_SHARE ** 2) if oss else 1.0
    act_rms = swiglu_oai_rms(EXPERT_BIAS_STD) if oss else SWIGLU_RMS
    for il in range(s.n_layer):
        p = f"blk.{il}."
        r_attn, r_ffn = stream.read_std(2 * il), stream.read_std(2 * il + 1)
        qk = QK_GAIN if glm or oss else 1.0  # qwen3moe gets its gain from the q/k norm weights instead
        specs += [const(p + "attn_norm.weight", n),
                  reader(p + "attn_q.weight", q_dim, r_attn * qk), reader(p + "attn_k.weight", kv_dim, r_attn * qk),
                  reader(p + "attn_v.weight", kv_dim, r_attn)]
        if glm or oss:  # GLM-4.5 and gpt-oss have q/k/v biases and no q/k norms. A v bias passes through
            #             attention unchanged and adds the same vector to every token, layer after layer: keep
            #             it zero
            specs += [small(p + "attn_q.bias", q_dim, 0.1), small(p + "attn_k.bias", kv_dim, 0.1),
                      const(p + "attn_v.bias", kv_dim, 0.0)]
        specs.append(writer(p + "attn_output.weight", q_dim, attn_out_std))
        if oss:  # the output bias (required) would add one vector to every token like the v bias: zero
            specs += [const(p + "attn_output.bias", n, 0.0), small(p + "attn_sinks.weight", s.n_head, SINK_STD)]
        if not (glm or oss):
            specs += [const(p + "attn_q_norm.weight", s.head_dim, QK_GAIN),
                      const(p + "attn_k_norm.weight", s.head_dim, QK_GAIN)]
        specs.append(const(p + ("post_attention_norm.weight" if glm or oss else "ffn_norm.weight"), n))

        if il < s.n_dense_lead:
            specs += [reader(p + "ffn_gate.weight", s.n_ff, r_ffn), reader(p + "ffn_up.weight", s.n_ff, r_ffn),
                      writer(p + "ffn_down.weight", s.n_ff, down_std(s.n_ff))]
            continue
        specs.append(_router(p + "ffn_gate_inp.weight", s, stream, 2 * il + 1, skew, seed))
        if glm:
            specs.append(small(p + "exp_probs_b.bias", s.n_expert, PROBS_BIAS_STD))
        if oss:  # gpt-oss's router bias adds to the logits it selects and weighs by: tiny, as exp_probs_b
            specs.append(small(p + "ffn_gate_inp.bias", s.n_expert, PROBS_BIAS_STD))
        down = down_std(s.expert_ff, share, w_rms, act_rms)
        specs += [reader(p + "ffn_gate_exps.weight", s.expert_ff, r_ffn, s.n_expert),
                  reader(p + "ffn_up_exps.weight", s.expert_ff, r_ffn, s.n_expert),
                  writer(p + "ffn_down_exps.weight", s.expert_ff, down, s.n_expert, down_qtype or qtype)]
        if oss:
            # the down bias's RMS: DOWN_BIAS_SHARE of one expert's output (its matrix part has `share` of it)
            down_bias = DOWN_BIAS_SHARE * a * EMBD_STD / w_rms
            specs += [expert_bias(p + "ffn_gate_exps.bias", s.expert_ff, EXPERT_BIAS_STD),
                      expert_bias(p + "ffn_up_exps.bias", s.expert_ff, EXPERT_BIAS_STD),
                      expert_bias(p + "ffn_down_exps.bias", n, down_bias, zero0=True)]
        if glm:
            sh_ff = s.expert_ff * s.n_shared
            specs += [reader(p + "ffn_gate_shexp.weight", sh_ff, r_ffn),
                      reader(p + "ffn_up_shexp.weight", sh_ff, r_ffn),
                      writer(p + "ffn_down_shexp.weight", sh_ff, down_std(sh_ff, share))]

    # output head: Q8_0 like llama.cpp's own low-bit quantizations keep it at higher precision; it ignores
    # the massive coordinate so logits carry no per-token offset from it
    specs += [const("output_norm.weight", n),
              TensorSpec("output.weight", (s.n_vocab, n), QT.Q8_0, std=stream.read_std(2 * s.n_layer), in0=0.0)]
    return specs


def _router(name: str, s: ModelShape, stream: _Stream, sublayers_before: int, skew: float,
            seed: int) -> TensorSpec:
    n = s.n_embd
    # columns 1..: token-dependent logits of std ROUTER_LOGIT_STD; column 0 reads the massive coordinate and
    # gives expert e the offset skew * z_e (in the same units)
    col_std = ROUTER_LOGIT_STD * stream.read_std(sublayers_before)
    h0 = stream.h0(sublayers_before)

    def values() -> np.ndarray:
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        w = np.empty((s.n_expert, n), np.float32)
        w[:, 1:] = rng.standard_normal((s.n_expert, n - 1)) * col_std
        z = rng.exponential(size=s.n_expert) - 1.0
        z = (z - z.mean()) / (z.std() or 1.0)
        w[:, 0] = skew * ROUTER_LOGIT_STD * z / h0
        return w

    return TensorSpec(name, (s.n_expert, n), QT.F32, values=values)
