"""Expert cache profiles: the GGUF file that a patched build writes with --moe-cache-profile FILE
(LLAMA_MOE_CACHE_PROFILE), read with the `gguf` package for `profile show` and `plot --profile`.

The file's keys and its `decode` and `prompt` count tensors (numpy shape (n_layer, n_expert)) are described in
docs/expert-cache.md, "Profiles"; native/src/llama-moe-cache-profile.h writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pyllama_moe.errors import UserError

FORMAT = "pyllama_moe.expert_cache_profile"
VERSION = 1
PREFIX = "pyllama_moe.profile."
NOT_PROFILE_FIX = "pass a file written by a patched build with --moe-cache-profile FILE (LLAMA_MOE_CACHE_PROFILE)"


@dataclass
class Profile:
    path: Path
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    router_hash: int
    n_runs: int
    decode: np.ndarray  # (n_layer, n_expert) int64
    prompt: np.ndarray  # (n_layer, n_expert) int64


def _field(reader, name: str):
    f = reader.fields.get(PREFIX + name)
    if f is None:
        raise KeyError(PREFIX + name)
    value = f.contents()
    return value


def read(path: Path | str) -> Profile:
    """The profile at path, or one UserError that says what is wrong with it."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} does not exist", NOT_PROFILE_FIX)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct errors, IndexError... on a corrupt file
        raise UserError(f"{path} is not a GGUF file, or a truncated one ({exc})", NOT_PROFILE_FIX) from exc
    try:
        if _field(reader, "format") != FORMAT:
            raise UserError(f"{path} is a GGUF file but not an expert cache profile", NOT_PROFILE_FIX)
        version = int(_field(reader, "version"))
        if version != VERSION:
            raise UserError(f"{path} has profile version {version}; this pyllama_moe reads {VERSION}",
                            "update pyllama_moe to the version of the build that wrote it")
        n_layer, n_expert = int(_field(reader, "n_layer")), int(_field(reader, "n_expert"))
        tensors = {t.name: t for t in reader.tensors}
        counts = {}
        for name in ("decode", "prompt"):
            t = tensors[name]
            if t.tensor_type != gguf.GGMLQuantizationType.I32:
                raise ValueError(f"tensor {name} is {t.tensor_type.name}, not I32")
            counts[name] = np.asarray(t.data, dtype=np.int64).reshape(n_layer, n_expert)
        return Profile(path, str(_field(reader, "arch")), n_layer, n_expert, int(_field(reader, "n_expert_used")),
                       int(_field(reader, "router_hash")), int(_field(reader, "n_runs")), counts["decode"], counts["prompt"])
    except UserError:
        raise
    except (KeyError, ValueError, TypeError) as exc:
        raise UserError(f"{path} is not a complete expert cache profile ({exc})", NOT_PROFILE_FIX) from exc


def layer_rows(p: Profile, top: int = 8) -> list[dict]:
    """Per layer with any count: its decode routings, prompt routings, and the top experts by decode count (then
    prompt count) with their share of the layer's decode routings."""
    rows = []
    for il in range(p.n_layer):
        dec, pro = p.decode[il], p.prompt[il]
        total = int(dec.sum())
        if total == 0 and int(pro.sum()) == 0:
            continue
        order = sorted(range(p.n_expert), key=lambda e: (-int(dec[e]), -int(pro[e]), e))[:top]
        rows.append({"layer": il, "decode": total, "prompt": int(pro.sum()),
                     "top": [(e, int(dec[e]), (int(dec[e]) / total) if total else 0.0) for e in order if dec[e] or pro[e]]})
    return rows


def show_text(p: Profile, top: int = 8) -> str:
    lines = [f"{p.path}: {p.arch}, {p.n_layer} layers, {p.n_expert} experts (top-{p.n_expert_used}), "
             f"router hash {p.router_hash:016x}, {p.n_runs} run{'s' if p.n_runs != 1 else ''}",
             f"decode routings {int(p.decode.sum())}, prompt routings {int(p.prompt.sum())} (seeding ubatches)"]
    rows = layer_rows(p, top)
    if not rows:
        lines.append("no layer has a count")
    for r in rows:
        tops = ", ".join(f"{e}:{100 * share:.1f}%" for e, _, share in r["top"])
        lines.append(f"layer {r['layer']:3d}: decode {r['decode']:9d}  prompt {r['prompt']:9d}  top {tops}")
    return "\n".join(lines)


def heat_figure(p: Profile, title: str = ""):
    """Layers x experts, the share of each layer's decode routings (prompt routings where a layer has none)."""
    from matplotlib.figure import Figure

    counts = p.decode.astype(float)
    no_decode = counts.sum(axis=1) == 0
    counts[no_decode] = p.prompt[no_decode]
    totals = counts.sum(axis=1, keepdims=True)
    share = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    fig = Figure(figsize=(min(16.0, max(7.0, 3.0 + 0.08 * p.n_expert)), min(12.0, max(3.0, 2.0 + 0.18 * p.n_layer))),
                 layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(share, aspect="auto", interpolation="nearest", cmap="magma", origin="upper")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    fig.colorbar(im, ax=ax, label="share of the layer's routings")
    runs = f"{p.n_runs} run{'s' if p.n_runs != 1 else ''}"
    fig.suptitle(title or f"{p.path.name}: {p.arch}, {int(p.decode.sum())} decode routings, {runs}")
    return fig


def cmd_profile(args) -> int:
    p = read(args.file)
    if args.json:
        import json

        print(json.dumps({"arch": p.arch, "n_layer": p.n_layer, "n_expert": p.n_expert, "n_expert_used": p.n_expert_used,
                          "router_hash": f"{p.router_hash:016x}", "n_runs": p.n_runs,
                          "layers": layer_rows(p, args.top)}, indent=1))
    else:
        print(show_text(p, args.top))
    return 0


def register(sub) -> None:
    from pyllama_moe.arguments import count, input_file

    p = sub.add_parser("profile", help="an expert cache profile (--moe-cache-profile FILE): per layer the routings and top experts")
    p.add_argument("action", choices=("show",), help="show: print the profile")
    p.add_argument("file", type=input_file("profile"), help="the profile file")
    p.add_argument("--top", type=count("an expert count"), default=8, help="experts listed per layer (default 8)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_profile)
