"""Per-layer expert routing histogram of a model, measured with the real llama.cpp in a child process
(pyllama_moe/worker/mode_routes.py, started by probe.py); this module checks the inputs, summarises the counts
and formats the table. "Top-10% share": docs/synthetic-models.md, "Routes".
"""

from __future__ import annotations

import math
import os

from pyllama_moe.errors import UserError
from pyllama_moe.synth.gguf_read import read_gguf
from pyllama_moe.synth.probe import run_probe

# glyphs for an expert group's count relative to the uniform expectation (count / mean count)
_RAMP = " .:-=+*#%@"
_RAMP_EDGES = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
PROFILE_CELLS = 32


def route_histogram(model_path: str | os.PathLike, lib_dir: str | os.PathLike,
                    llama_cpp_pkg_parent: str | os.PathLike, n_tokens: int = 512, seed: int = 0,
                    threads: int | None = None, *, n_gpu_layers: int = 0, timeout: float | None = None) -> dict:
    """Decode `n_tokens` random tokens (one sequence) and count each MoE layer's expert selections.

    Returns {"model", "arch", "n_expert", "n_expert_used", "n_tokens", "layers": [per-layer dict], "summary",
    "logits", "seconds"}; each layer has "layer", "counts", "used", "top10_share", "max", "min", "profile" and
    the router logits' "token_spread" / "expert_bias_std".
    """
    if n_tokens < 1:
        raise UserError(f"{n_tokens} tokens", "use at least 1")
    info = read_gguf(model_path)
    n_expert = int(info.arch_key("expert_count", 0) or 0)
    if n_expert <= 0:
        raise UserError(f"{model_path} ({info.arch or 'unknown architecture'}) has no experts",
                        "give a Mixture-of-Experts model")
    n_ctx_train = int(info.arch_key("context_length", 0) or 0)
    if n_ctx_train and n_tokens > n_ctx_train:
        raise UserError(f"{n_tokens} tokens is more than the model's context of {n_ctx_train}", "use fewer tokens")
    raw = run_probe("routes", model_path, lib_dir, llama_cpp_pkg_parent, timeout=timeout, n_tokens=n_tokens,
                    seed=seed, threads=threads, n_gpu_layers=n_gpu_layers, n_expert=n_expert)
    if not raw["layers"]:
        raise UserError(f"llama.cpp reported no ffn_moe_topk tensors for {model_path}",
                        "this architecture's graph does not name its routing tensors; routes can't see it")
    layers = [summarize_layer(int(il), d) for il, d in sorted(raw["layers"].items(), key=lambda kv: int(kv[0]))]
    k = layers[0]["k"]
    return {
        "model": str(model_path), "arch": info.arch, "n_expert": n_expert, "n_expert_used": k,
        "n_tokens": n_tokens, "seed": seed, "threads": raw["threads"],
        "layers": layers,
        "summary": {
            "min_used": min(L["used"] for L in layers),
            "mean_top10_share": sum(L["top10_share"] for L in layers) / len(layers),
            "min_top10_share": min(L["top10_share"] for L in layers),
            "max_top10_share": max(L["top10_share"] for L in layers),
        },
        "logits": raw["logits"], "seconds": raw["seconds"],
    }


def summarize_layer(il: int, d: dict) -> dict:
    counts = [int(c) for c in d["counts"]]
    n = len(counts)
    total = sum(counts)
    top = sorted(counts, reverse=True)
    n_top = max(1, math.ceil(0.1 * n))
    return {
        "layer": il, "counts": counts, "k": d["k"], "tokens": d["tokens"],
        "used": sum(1 for c in counts if c > 0),
        "top10_share": sum(top[:n_top]) / total if total else 0.0,
        "max": top[0], "min": top[-1],
        "profile": profile(counts),
        "token_spread": d.get("token_spread"), "expert_bias_std": d.get("expert_bias_std"),
        "stream": d.get("stream"),
    }


def profile(counts: list[int], cells: int = PROFILE_CELLS) -> str:
    """Experts sorted by count, most used first, in `cells` groups; one glyph per group for its mean count
    relative to the uniform expectation (' ' unused ... '=' about even ... '@' 6x or more)."""
    n = len(counts)
    mean = sum(counts) / n if n else 0.0
    top = sorted(counts, reverse=True)
    cells = min(cells, n)
    out = []
    for c in range(cells):
        group = top[c * n // cells:(c + 1) * n // cells]
        r = (sum(group) / len(group)) / mean if mean else 0.0
        # ' ' only when no expert in the group was used at all
        level = max(1, max(i for i, e in enumerate(_RAMP_EDGES) if r >= e)) if r > 0 else 0
        out.append(_RAMP[level])
    return "".join(out)


def format_table(result: dict) -> str:
    n, k = result["n_expert"], result["n_expert_used"]
    n_top = max(1, math.ceil(0.1 * n))
    lines = [
        f"model {result['model']}",
        f"arch {result['arch']}, {n} experts, top-{k}, {result['n_tokens']} random tokens (seed {result['seed']}), "
        f"{result['n_tokens'] * k} selections per layer; logits finite: {result['logits']['finite']}",
        f"top10% = share of selections going to the {n_top} most used experts; profile = experts sorted by use,"
        f" {n // min(n, PROFILE_CELLS)} per glyph, ' .:-=+*#%@' from unused to >=6x the mean",
        "",
        f"{'layer':>5} {'used':>9} {'top10%':>6} {'max':>5} {'min':>4}  profile",
    ]
    for L in result["layers"]:
        lines.append(f"{L['layer']:>5} {L['used']:>4}/{n:<4} {L['top10_share']:>6.3f} {L['max']:>5} {L['min']:>4}"
                     f"  |{L['profile']}|")
    s = result["summary"]
    lines += ["", f"all layers: min used {s['min_used']}/{n}, top10% mean {s['mean_top10_share']:.3f} "
                  f"(min {s['min_top10_share']:.3f}, max {s['max_top10_share']:.3f})"]
    return "\n".join(lines)
