"""The `synth`, `corpus` and `routes` verbs. `register(subparsers)` adds them to the main parser; each sets
`func` to a handler that takes the parsed args and returns an exit code (bad input raises UserError)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pyllama_moe.arguments import (count, input_dir, input_file, LLAMA_THREADS, output_file, real_number,
                                   refuse_overwrite, SEED, whole_number)
from pyllama_moe.cli.args import model_header
from pyllama_moe.synth.shapes import ARCHS, OVERRIDES, PRESETS, resolve_shape
from pyllama_moe.synth.writer import QTYPES, write_model

_OVERRIDE_HELP = {
    "layers": "transformer blocks", "hidden": "embedding width", "heads": "attention heads",
    "kv_heads": "key/value heads", "head_dim": "width of one head", "experts": "routed experts per layer",
    "experts_used": "experts chosen per token (top-k)", "expert_ff": "hidden width of one expert",
    "ff": "hidden width of a dense FFN (glm4moe's leading layers)", "vocab": "tokenizer size",
    "ctx": "training context length", "shared_experts": "shared experts per layer (glm4moe)",
    "dense_layers": "leading dense layers (glm4moe)", "sliding_window": "sliding-window width (gpt-oss)",
}
_MAY_BE_ZERO = ("shared_experts", "dense_layers", "sliding_window")  # an architecture without them has 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "synth", help="write a random-weight MoE model (GGUF)",
        description="Write a random-weight qwen3moe/glm4moe/gpt-oss GGUF with realistic expert routing, streaming "
                    f"(any size). Presets: {', '.join(PRESETS)}.")
    p.add_argument("--preset", default="tiny", choices=tuple(PRESETS), metavar="PRESET", help=f"base shape ({', '.join(PRESETS)}; default tiny)")
    p.add_argument("--arch", default=None, choices=ARCHS, metavar="ARCH", help=f"{' or '.join(ARCHS)} (default: the preset's)")
    p.add_argument("--type", dest="qtype", default="q4_0", choices=tuple(QTYPES), metavar="TYPE",
                   help=f"expert, attention and dense/shared FFN weights: {' or '.join(QTYPES)} (default q4_0;"
                        " token embedding F16, output Q8_0, norms and routers F32)")
    p.add_argument("--down-type", dest="down_qtype", default=None, choices=tuple(QTYPES), metavar="TYPE",
                   help="the routed experts' down matrices, where they differ from --type (as llama-quantize's mixes "
                        "keep them wider: two types in one layer's experts)")
    p.add_argument("--skew", type=real_number("a skew", 0, 10), default=0.0,
                   help="expert popularity skew: 0 uniform, 0.5 top-10%% of experts get ~45%% of the "
                        "selections, 1 ~70%% (default 0)")
    p.add_argument("--seed", type=SEED, default=0, help="same seed and options, same bytes (default 0)")
    p.add_argument("-o", "--output", type=output_file("model file"), required=True, help="the .gguf file to write")
    for name, field in OVERRIDES.items():
        size = whole_number("a size", 0 if name in _MAY_BE_ZERO else 1)
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=size, default=None,
                       help=f"{_OVERRIDE_HELP[name]} (default: the preset's {field})")
    p.add_argument("--residual-scale", type=real_number("a scale", 0), default=0.1,
                   help="how much each sublayer adds to the residual stream, relative to the token "
                        "embedding (default 0.1)")
    p.add_argument("--threads", type=count("a thread count"), default=None, help="generator threads (default: up to 8)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=cmd_synth)

    p = subparsers.add_parser(
        "corpus", help="write Zipf-distributed text in a model's vocabulary",
        description="Write about N tokens of synthetic text made of the model's whole-word tokens "
                    "(Zipf frequencies, sentences, paragraphs), e.g. for llama-perplexity.")
    p.add_argument("--model", type=input_file("model"), required=True, help="GGUF whose vocabulary to use")
    p.add_argument("--tokens", type=count("a token count"), default=20000,
                   help="approximate size in tokens (default 20000)")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the text (default 0)")
    p.add_argument("-o", "--output", type=output_file("text file", stdout_dash=True), default="-",
                   help="text file to write (default: stdout)")
    p.set_defaults(func=cmd_corpus)

    p = subparsers.add_parser(
        "routes", help="per-layer expert routing histogram, measured with llama.cpp",
        description="Decode random tokens (one sequence) with the real llama.cpp in a child process, capture "
                    "every MoE layer's expert choice (ffn_moe_topk) and print a per-layer histogram.")
    p.add_argument("model", type=input_file("model"), help="GGUF model")
    p.add_argument("--lib", type=input_dir("library folder"),
                   help="folder with libllama and libggml-base (default: the bin/ of the master CPU build, built if "
                        "missing)")
    p.add_argument("--llama-cpp-pkg", type=input_dir("package folder"),
                   help="folder containing the matching llama_cpp (llama-cpp-python) package (default: the sdist's)")
    p.add_argument("--tokens", type=count("a token count"), default=512, help="random tokens to decode (default 512)")
    p.add_argument("--seed", type=SEED, default=0, help="seed for the random tokens (default 0)")
    p.add_argument("--threads", type=LLAMA_THREADS, default=None, help="llama.cpp threads (default: all cores, as 0)")
    p.add_argument("--gpu-layers", type=whole_number("a GPU layer count", -1, note="-1: all"), default=0,
                   help="layers to offload to a GPU build (default 0)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.set_defaults(func=cmd_routes)


def cmd_synth(args: argparse.Namespace) -> int:
    shape = resolve_shape(args.preset, args.arch, **{k: getattr(args, k) for k in OVERRIDES})
    r = write_model(args.output, shape, args.qtype, down_qtype=args.down_qtype, skew=args.skew, seed=args.seed,
                    residual_scale=args.residual_scale, threads=args.threads, progress=not args.quiet,
                    name=f"pyllama-moe synthetic {args.preset} {shape.arch}")
    down = f" (down experts {args.down_qtype.upper()})" if args.down_qtype else ""
    print(f"wrote {r.path}: {shape.arch}, {shape.n_layer} layers, hidden {shape.n_embd}, {shape.n_expert} experts "
          f"(top-{shape.n_expert_used}, ff {shape.expert_ff}), vocab {shape.n_vocab}, {_si(r.n_params)} params, "
          f"{args.qtype.upper()}{down}, skew {args.skew:g}, seed {args.seed}: {_si(r.n_bytes)}B in {r.seconds:.1f} s")
    return 0


def _si(n: float) -> str:
    return f"{n / 1e9:.2f} G" if n >= 1e9 else f"{n / 1e6:.1f} M"


def cmd_corpus(args: argparse.Namespace) -> int:
    from pyllama_moe.synth.corpus import corpus_from_model

    refuse_overwrite({"-o/--output": args.output}, {"--model": args.model})
    model_header(args.model)  # a foreign file is named with its flag, before any text is made
    text = corpus_from_model(args.model, args.tokens, args.seed)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        out = Path(args.output)
        out.write_text(text, encoding="utf-8")
        print(f"wrote {out}: ~{args.tokens} tokens, {len(text.split())} words, {len(text)} characters",
              file=sys.stderr)
    return 0


def cmd_routes(args: argparse.Namespace) -> int:
    from pyllama_moe.synth.routes import format_table, route_histogram

    model = Path(args.model)
    model_header(model, "model")  # before the master build that reads it is made
    if model.is_file() and model.stat().st_size > 1e9:  # the child process is silent while it works
        print(f"routes: loading {model.stat().st_size / 1e9:.1f} GB and decoding {args.tokens} tokens with "
              "llama.cpp (about a minute on a small CPU box)...", file=sys.stderr, flush=True)
    lib, pkg = args.lib, args.llama_cpp_pkg
    if lib is None or pkg is None:
        from pyllama_moe.build.builder import resolve
        from pyllama_moe.source import sdist as source

        src = source.ensure_source()
        lib = lib or resolve("master", "cpu").bin_dir
        pkg = pkg or src.python_dir
    result = route_histogram(args.model, lib, pkg, n_tokens=args.tokens, seed=args.seed,
                             threads=args.threads, n_gpu_layers=args.gpu_layers)
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0
