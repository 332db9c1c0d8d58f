"""The two pictures of docs/expert-cache.md, drawn with matplotlib from this file alone:

    python3 tools/docs_figures.py            # writes docs/img/expert-cache-data-path.svg and docs/img/decode-step.svg
    python3 tools/docs_figures.py --out DIR  # elsewhere (tests/test_docs_figures.py); --png adds PNGs to look at

What they show comes from docs/expert-cache.md, docs/cache-paths.md, docs/prefetch.md and the native code they name
(native/src/llama-moe-cache-rt.h, native/ggml/src/ggml-cuda/moe-cache-{lookup,fill}.cu). The timeline's lengths are
schematic: it draws the order of the work and where the host waits, not a measurement.

The SVGs keep text as text and are deterministic (fixed hash salt, no date), so a rerun with the same matplotlib gives
the same bytes and the committed pictures can be checked against this script.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from matplotlib import rc_context  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402
from matplotlib.path import Path as MplPath  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NAMES = ("expert-cache-data-path", "decode-step")

# what every picture is drawn and saved with: text as text, the bundled font (so positions do not depend on the
# fonts a machine has), ids from a fixed salt and no date, so that the same matplotlib writes the same bytes
RC = {"svg.fonttype": "none", "svg.hashsalt": "pyllama-moe-docs", "font.family": "DejaVu Sans", "font.size": 8,
      "path.simplify": False}

# colours: host memory and the CPU warm, the GPU's memory cool, the ops green, PCIe grey
HOST, HOST_EDGE = "#fdf1dc", "#b07a1e"
PINNED, PAGEABLE = "#f9dca8", "#fbeedb"
GPU, GPU_EDGE = "#eaf1fb", "#3b6db3"
MEM = "#cfe0f7"
OP, OP_EDGE = "#dff2e1", "#2f8a3e"
STATE = "#efe3f7"
PCIE, PCIE_EDGE = "#e6e6e6", "#7a7a7a"
CPU_PATH, GPU_PATH = "#f6c88f", "#a9d8ae"
INK = "#222222"
FILL_ARROW = "#c0392b"
PROMPT_ARROW = "#3b6db3"


def _box(ax, x, y, w, h, title=None, body=None, fc="white", ec=INK, lw=1.0, ls="-", size=7.5, title_size=8.5,
         align="center", z=2, pad_top=1.1):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.8", fc=fc, ec=ec, lw=lw, ls=ls,
                                zorder=z))
    tx = x + w / 2 if align == "center" else x + 1.0
    top = y + h - pad_top
    if title:
        ax.text(tx, top, title, ha=align, va="top", fontsize=title_size, fontweight="bold", color=INK, zorder=z + 1)
        top -= 1.75 * (title.count("\n") + 1) * title_size / 8.5 + 0.4
    if body:
        ax.text(tx, top, body, ha=align, va="top", fontsize=size, color=INK, zorder=z + 1, linespacing=1.25)


def _arrow(ax, points, color=INK, lw=1.3, ls="-", style="-|>", z=4, both=False):
    codes = [MplPath.MOVETO] + [MplPath.LINETO] * (len(points) - 1)
    ax.add_patch(FancyArrowPatch(path=MplPath(points, codes), arrowstyle=("<|-|>" if both else style),
                                 mutation_scale=9, color=color, lw=lw, ls=ls, zorder=z, shrinkA=0, shrinkB=0))


def _label(ax, x, y, text, color=INK, size=7, ha="center", va="center", bg=True, z=5, style="normal"):
    box = dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.9) if bg else None
    ax.text(x, y, text, ha=ha, va=va, fontsize=size, color=color, bbox=box, zorder=z, linespacing=1.2, style=style)


def _slots(ax, x, y, w, label, experts, cell_h=1.9):
    """One bank drawn as a row of slots; experts: the expert id a slot holds, None where it is free."""
    ax.text(x - 0.6, y + cell_h / 2, label, ha="right", va="center", fontsize=7, color=INK, zorder=4)
    cw = w / len(experts)
    for i, e in enumerate(experts):
        ax.add_patch(Rectangle((x + i * cw, y), cw, cell_h, fc=(MEM if e is not None else "white"), ec=GPU_EDGE, lw=0.7,
                               zorder=3))
        ax.text(x + (i + 0.5) * cw, y + cell_h / 2, "" if e is None else str(e), ha="center", va="center", fontsize=6.5,
                color=INK, zorder=4)


def data_path_figure() -> Figure:
    fig = Figure(figsize=(10.2, 8.9))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 120)
    ax.set_ylim(-30, 74.7)
    ax.axis("off")

    ax.text(1, 73.2, "The expert cache's data path: host memory, PCIe and the GPU of a cached MoE layer", fontsize=11,
            fontweight="bold", va="top", color=INK)

    # host memory and the CPU
    _box(ax, 1, 10, 28, 58, fc=HOST, ec=HOST_EDGE, lw=1.4)
    ax.text(15, 66.6, "host memory", ha="center", va="top", fontsize=10, fontweight="bold", color=INK, zorder=3)
    ax.text(15, 64.0, "the experts of each MoE layer on\nthe host (--cpu-moe, -ncmoe N,\n--fit): per layer "
            "ffn_gate / up /\ndown_exps, E experts each", ha="center", va="top", fontsize=7, color=INK, zorder=3,
            linespacing=1.25)
    for row, name in enumerate(("gate", "up", "down")):
        yy = 54.6 - row * 2.3
        ax.text(6.4, yy + 0.9, name, ha="right", va="center", fontsize=6.5, zorder=4)
        for i in range(10):
            ax.add_patch(Rectangle((7 + i * 2.0, yy), 2.0, 1.8, fc="white", ec=HOST_EDGE, lw=0.6, zorder=3))
            ax.text(8 + i * 2.0, yy + 0.9, "…" if i == 8 else ("E-1" if i == 9 else str(i)), ha="center", va="center",
                    fontsize=(5 if i == 9 else 6), zorder=4)
    _box(ax, 2.5, 31, 25, 16, "pageable", "mmap, where pinning is off,\nover the pin budget or refused:\n"
         "no device lookup, the layer's\ndecode takes the host-side plan", fc=PAGEABLE, ec=HOST_EDGE, ls="--", size=7,
         title_size=8)
    _box(ax, 2.5, 12, 25, 17, "pinned (page-locked)", "the mapped expert ranges,\nregistered with the GPU in place\n"
         "at load, one range at a time\n(else copied into pinned memory);\nthe GPU reads them in place", fc=PINNED,
         ec=HOST_EDGE, size=7, title_size=8)
    _box(ax, 1, -1, 28, 9, "CPU", "computes the host experts of layers\non the `staging` and `host` paths (T < O)",
         fc="#fbe3c4", ec=HOST_EDGE, size=6.8, title_size=8, pad_top=1.0)

    # PCIe
    ax.add_patch(Rectangle((31.5, -1), 5, 69, fc=PCIE, ec=PCIE_EDGE, lw=0.8, zorder=1))
    ax.text(34, 33.5, "PCIe", ha="center", va="center", rotation=90, fontsize=10, fontweight="bold", color="#555555",
            zorder=2)

    # the GPU
    _box(ax, 39, -1, 80, 69, fc=GPU, ec=GPU_EDGE, lw=1.4, z=1)
    ax.text(79, 66.6, "GPU (the device of the cached layer)", ha="center", va="top", fontsize=10, fontweight="bold",
            color=INK, zorder=3)

    # prompts: the staging arena
    _box(ax, 42, 51, 48, 12.5, "prefetch staging arena  (prompts)", "a ring of the splits' staged copies, up to depth (4)\n"
         "splits at once, uploaded ahead on the copy queue. A cached\nlayer's copy the cache writes: residents copied "
         "from the\nbanks, the rest uploaded, in runs of consecutive experts", fc=MEM, ec=GPU_EDGE, size=7)
    # the banks of one cached layer
    _box(ax, 62, 31, 38, 16, "banks of cached layer il  (decode)", None, fc="white", ec=GPU_EDGE)
    ax.text(85, 43.1, "slot 0 … S-1  (numbers: the expert held)", ha="center", va="center", fontsize=6.3,
            color="#555555", zorder=4)
    for row, name in enumerate(("gate", "up", "down")):
        _slots(ax, 72, 39.6 - row * 2.2, 26, name, [3, 7, 12, 0, None, 9], cell_h=1.8)
    ax.text(81, 31.6, "a bank per expert tensor, S slots each; a slot holds\none expert of every tensor, with its "
            "biases and scales", ha="center", va="bottom", fontsize=6.5, zorder=4, linespacing=1.2)

    # decode on the device: router -> lookup <-> state, -> fill -> matmuls
    _box(ax, 42, 31, 16, 12.5, "slot state (layer)", "slot_of[E], expert_of[S],\nCLOCK bits, hand, n_free,\n"
         "counters, uses; + a\nstatus word (refusals)", fc=STATE, ec="#7a4aa0", size=6.6, title_size=7.8)
    _box(ax, 42, 17, 13, 10, "router", "top-k ids\nof the token(s)", fc=OP, ec=OP_EDGE, size=7)
    _box(ax, 60, 17, 17, 10, "lookup", "MOE_CACHE_LOOKUP,\none CUDA block:\nids → slot ids, misses", fc=OP,
         ec=OP_EDGE, size=6.6)
    _box(ax, 82, 17, 17, 10, "fill, one per bank", "MOE_CACHE_FILL:\neach miss into\nits slot", fc=OP, ec=OP_EDGE,
         size=6.6, title_size=8)
    _box(ax, 104, 17, 13, 46.5, "expert\nmatmuls", "MUL_MAT_ID\n\nprompts:\nthe staged\ncopy, the\nrouter's ids\n\n"
         "decode:\nthe banks,\nslot ids\n\nwhole layers:\nthe banks,\nthe router's\nids (in_place)", fc=OP,
         ec=OP_EDGE, size=6.8)

    # arrows inside the GPU
    _arrow(ax, [(55, 22), (60, 22)], color=OP_EDGE)                                 # router -> lookup
    _arrow(ax, [(52, 31), (64, 27)], color="#7a4aa0", both=True)                    # state <-> lookup
    _label(ax, 61.5, 29.6, "read and\nupdated in place", size=6.0, color="#7a4aa0", bg=False, ha="left")
    _arrow(ax, [(77, 22), (82, 22)], color=OP_EDGE)                                 # lookup -> fill
    _arrow(ax, [(92, 27), (92, 31)], color=FILL_ARROW)                             # fill -> banks
    _arrow(ax, [(99, 22), (104, 22)], color=OP_EDGE)                                # fill -> matmuls
    _arrow(ax, [(100, 39), (104, 39)], color=GPU_EDGE)                              # banks -> matmuls
    _arrow(ax, [(90, 58), (104, 58)], color=GPU_EDGE)                               # staging -> matmuls
    _label(ax, 97, 60.3, "the staged\ncopy", size=6.5, bg=False)
    _arrow(ax, [(66, 47), (66, 51)], color=GPU_EDGE)                                # banks -> staging (residents)
    _label(ax, 66.8, 49, "residents copied\non the device", size=6.3, ha="left", bg=False)
    _arrow(ax, [(86, 51), (86, 47)], color=GPU_EDGE)                                # staging -> banks (admits)
    _label(ax, 86.8, 49, "admits into free\nslots; seeds", size=6.3, ha="left", bg=False)

    # across PCIe: prompt uploads (pinned or pageable), decode fills (pinned, read in place), the host-side plan
    _arrow(ax, [(29, 58), (42, 58)], color=PROMPT_ARROW, lw=2.2)
    _label(ax, 35.5, 61.3, "prompt uploads\n(pinned or pageable)", size=6.5, color=PROMPT_ARROW)
    _arrow(ax, [(27.5, 14), (90.5, 14), (90.5, 17)], color=FILL_ARROW, lw=2.2)
    _label(ax, 66, 11.6, "decode fills: the fill kernels' loads read each miss from the page-locked experts "
           "in place (no copy engine)", size=6.6, color=FILL_ARROW, bg=False)
    _arrow(ax, [(27.5, 45), (62, 45)], color=HOST_EDGE, lw=1.3, ls="--")
    _label(ax, 51, 47.9, "host-side plan: ids read back,\nmisses uploaded on the layer's stream", size=6.1,
           color=HOST_EDGE, bg=False)

    # what the arrows across PCIe carry
    for i, (color, ls, text) in enumerate((
            (FILL_ARROW, "-", "decode on the device: the fills of the misses, from pinned memory only"),
            (PROMPT_ARROW, "-", "prompts: uploads into the staging arena, on the copy queue"),
            (HOST_EDGE, "--", "decode with the host-side plan (pageable experts, LLAMA_MOE_CACHE_DEVICE=0): "
                              "a synchronization per layer"))):
        yy = 6.6 - i * 2.6
        _arrow(ax, [(42, yy), (48, yy)], color=color, lw=(1.3 if ls == "--" else 2.0), ls=ls)
        ax.text(49.5, yy, text, va="center", fontsize=6.6, color=INK, zorder=4)

    _graph_sizes(ax)
    return fig


def _graph_sizes(ax):
    """Which graphs read the banks, which take the staging path and which compute on the CPU, by graph size T."""
    ax.text(1, -6.5, "Which path a cached layer takes, by graph size T (tokens of the ubatch); widths not to scale",
            fontsize=9, fontweight="bold", va="center", color=INK)
    x0, x1 = 14, 119
    cols = [(x0, 46, "T ≤ D"), (46, 66, "D < T < O"), (66, 88, "O ≤ T < 128"), (88, x1, "T ≥ 128  (prefetch min batch)")]
    for a, b, head in cols:
        ax.text((a + b) / 2, -9.3, head, ha="center", va="center", fontsize=7.5, fontweight="bold", color=INK)

    def cell(a, b, y, h, text, fc):
        ax.add_patch(FancyBboxPatch((a + 0.3, y), b - a - 0.6, h, boxstyle="round,pad=0,rounding_size=0.5", fc=fc,
                                    ec="#8a8a8a", lw=0.6, zorder=2))
        ax.text((a + b) / 2, y + h / 2, text, ha="center", va="center", fontsize=6.8, color=INK, zorder=3,
                linespacing=1.2)

    ax.text(x0 - 0.8, -14.5, "partial layer", ha="right", va="center", fontsize=7.5, fontweight="bold")
    cell(x0, 46, -13.2, 3.2, "T·k ≤ S and T ≤ V: `device` / `host_plan`\nbanks read through slot ids", GPU_PATH)
    cell(x0, 46, -16.9, 3.2, "T·k > S or T > V: `staging`\nthe host weights, on the CPU", CPU_PATH)
    cell(46, 66, -16.9, 6.9, "`host`\nthe host weights,\non the CPU", CPU_PATH)
    cell(66, 88, -16.9, 6.9, "`host`, offloaded\nits routed experts copied\nat split time", GPU_PATH)
    cell(88, x1, -16.9, 6.9, "`host`, uploaded ahead into the staging\narena: residents copied from the banks,\n"
         "the rest uploaded over PCIe", GPU_PATH)
    ax.text(x0 - 0.8, -19.7, "whole layer", ha="right", va="center", fontsize=7.5, fontweight="bold")
    cell(x0, x1, -21.3, 3.2, "a slot per expert, all resident: `in_place` at any T (T ≤ D with --no-op-offload): the "
         "banks read with the router's own ids, no lookup, no fill", GPU_PATH)
    ax.add_patch(Rectangle((x0 + 0.3, -24.6), 2.2, 1.6, fc=GPU_PATH, ec="#8a8a8a", lw=0.6))
    ax.text(x0 + 3.2, -23.8, "experts computed on the GPU", va="center", fontsize=6.8)
    ax.add_patch(Rectangle((x0 + 26.3, -24.6), 2.2, 1.6, fc=CPU_PATH, ec="#8a8a8a", lw=0.6))
    ax.text(x0 + 29.2, -23.8, "on the CPU", va="center", fontsize=6.8)
    ax.text(1, -27.6, "k: top-k   S: the layer's slots   D: LLAMA_MOE_CACHE_DECODE_MAX (8)   V: the device's "
            "mul_mat_id vector limit for the type (8 on the H200)\nO: GGML_OP_OFFLOAD_MIN_BATCH (32 on CUDA and SIM)"
            "   128: GGML_SCHED_PREFETCH_MIN_BATCH   (docs/cache-paths.md has the whole table)", fontsize=6.8,
            va="center", color="#333333", linespacing=1.3)


def decode_step_figure() -> Figure:
    fig = Figure(figsize=(10.2, 5.2))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 120)
    ax.set_ylim(0, 58.5)
    ax.axis("off")
    ax.text(1, 57.3, "One decode step with the device lookup: host thread, GPU stream and PCIe", fontsize=11,
            fontweight="bold", va="top", color=INK)
    ax.text(1, 54.5, "schematic, not to scale: the order of the work and where the host waits, not measured durations",
            fontsize=7.5, va="top", color="#a02020", style="italic")

    lanes = {"host": 47.0, "gpu": 31.0, "pcie": 18.0}
    names = {"host": "host thread", "gpu": "GPU compute\nstream", "pcie": "PCIe"}
    x0, x1 = 14, 119
    h = 6.0
    for k, y in lanes.items():
        ax.add_patch(Rectangle((x0, y - h / 2 - 1.0), x1 - x0, h + 2.0, fc="#f6f6f6", ec="none", zorder=0))
        ax.text(x0 - 1, y, names[k], ha="right", va="center", fontsize=8.5, fontweight="bold", color=INK)

    def seg(lane, a, b, text, fc, ec=INK, hatch=None, size=6.6, ls="-", color=INK):
        y = lanes[lane]
        ax.add_patch(Rectangle((a, y - h / 2), b - a, h, fc=fc, ec=ec, lw=0.7, hatch=hatch, ls=ls, zorder=2))
        if text:
            box = dict(boxstyle="round,pad=0.3", fc="white", ec="none") if hatch else None
            ax.text((a + b) / 2, y, text, ha="center", va="center", fontsize=size, color=color, zorder=3,
                    linespacing=1.15, bbox=box)

    # the host thread: build or reuse, inputs, bind, launch, queue the read-backs, wait, check
    seg("host", 14, 21, "graph built\nor reused", HOST)
    seg("host", 21, 25, "inputs", HOST)
    seg("host", 25, 29.5, "cache's\nbind", HOST)
    seg("host", 29.5, 35, "launch\nthe graph", HOST)
    seg("host", 35, 42, "queue the\nread-backs", HOST, size=6.3)
    seg("host", 42, 107.5, "waits: the one synchronization of the step\n(for the logits' and status words' read-back)",
        "white", ec=HOST_EDGE, hatch="////", size=7.2)
    seg("host", 107.5, 113, "status\nwords 0?", HOST)
    seg("host", 113, 119, "logits to\nthe caller", HOST)

    # the GPU stream: one CUDA graph; per cached layer attention, router, lookup, fills, expert matmuls
    layer = [("attention", 5.5, OP), ("router\ntop-k", 4.5, OP), ("look-\nup", 3.5, "#c9ead0"),
             ("fill", 4.0, "#f3c6c0"), ("expert\nmatmuls", 6.0, OP)]
    x = 36.0
    spans = []
    for il, misses in ((0, True), (1, False)):
        start = x
        for name, w, fc in layer:
            if name == "fill" and not misses:
                w = 1.2
                name = ""
            seg("gpu", x, x + w, name, fc, size=(5.9 if name == "attention" else 6.4))
            spans.append((il, name, x, x + w))
            x += w
        ax.text((start + x) / 2, lanes["gpu"] + h / 2 + 1.4, ("layer l: 2 misses" if misses else
                "layer l+1: all hits"), ha="center", va="center", fontsize=6.8, color=INK)
    hit_fill = [s for s in spans if s[0] == 1 and s[1] == ""][0]
    ax.annotate("fill returns at once:\nno misses", xy=((hit_fill[2] + hit_fill[3]) / 2, lanes["gpu"] - h / 2),
                xytext=((hit_fill[2] + hit_fill[3]) / 2 + 1.5, lanes["gpu"] - h / 2 - 5.4), fontsize=6.3, ha="center",
                va="center", arrowprops=dict(arrowstyle="-", color="#666666", lw=0.6), zorder=5)
    seg("gpu", x, x + 14.8, "… the other layers\n(cached: the same)", "#eef7ef", size=6.4)
    x += 14.8
    seg("gpu", x, x + 5, "logits", OP, size=6.4)
    x_end = x + 5
    # the graph's span
    ax.add_patch(Rectangle((36, lanes["gpu"] - h / 2 - 0.6), x_end - 36, h + 1.2, fc="none", ec=OP_EDGE, lw=1.4,
                           ls="--", zorder=4))
    ax.text(40, lanes["gpu"] + h / 2 + 4.0, "one CUDA graph per token: no routing read back, no callback, "
            "no host round trip between the layers", ha="left", va="center", fontsize=7.2, color=OP_EDGE,
            fontweight="bold")

    # PCIe: inputs up, the fills' reads, the read-backs down
    seg("pcie", 23, 28, "inputs\n(to GPU)", PCIE, size=6.2)
    fill0 = [s for s in spans if s[0] == 0 and s[1] == "fill"][0]
    seg("pcie", fill0[2], fill0[3], "", "#f3c6c0", ec=FILL_ARROW)
    ax.text(fill0[3] + 1.0, lanes["pcie"], "the misses' experts: loads of the fill\nkernels from page-locked host memory",
            ha="left", va="center", fontsize=6.4, color=FILL_ARROW)
    seg("pcie", x_end, x_end + 7, "logits +\nstatus words\n(to host)", PCIE, size=5.9)

    # dependencies: launch -> graph, fill reads, read-backs -> the host wakes
    _arrow(ax, [(32.5, lanes["host"] - h / 2), (36.5, lanes["gpu"] + h / 2 + 0.6)], color=INK, lw=0.9)
    _arrow(ax, [((fill0[2] + fill0[3]) / 2, lanes["pcie"] + h / 2), ((fill0[2] + fill0[3]) / 2, lanes["gpu"] - h / 2)],
           color=FILL_ARROW, lw=0.9)
    _arrow(ax, [(x_end - 0.5, lanes["gpu"] - h / 2), (x_end + 1.0, lanes["pcie"] + h / 2)], color=INK, lw=0.9)
    _arrow(ax, [(x_end + 7, lanes["pcie"] + h / 2), (108, lanes["host"] - h / 2)], color=INK, lw=0.9)
    _arrow(ax, [(x0, lanes["pcie"] - h / 2 - 2.2), (x1, lanes["pcie"] - h / 2 - 2.2)], color="#777777", lw=0.8)
    ax.text(x1, lanes["pcie"] - h / 2 - 3.4, "time (schematic)", ha="right", va="top", fontsize=6.5, color="#777777")

    ax.text(1, 9.6, "The lookup updates the layer's slot state on the device and adds any refusal to the layer's "
            "status word; the words are read back behind the logits, so the step's one wait covers both\n(a word "
            "not 0: llama_decode returns -3). The fill kernels are captured with a fixed shape: rows past the "
            "lookup's misses return at once, and the host never learns how many there were.\n"
            "With the host-side plan (pageable experts, LLAMA_MOE_CACHE_DEVICE=0) the host reads the router's ids "
            "back at every cached layer instead: measured on the H200, 50 host\nsynchronizations per token "
            "against 1 with the device lookup, the same as all on the GPU (results/moe-cache-device-gpu.md).\n"
            "The cache's bind uploads a layer's slot state only where the host-side planner's is newer (the first "
            "step after a prompt or the host-side plan).",
            fontsize=6.9, va="top", color="#333333", linespacing=1.35)
    return fig


FIGURES = {"expert-cache-data-path": data_path_figure, "decode-step": decode_step_figure}


def write(out: Path, png: bool = False) -> list[Path]:
    """Draw both pictures into out (created if missing); returns the SVGs written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with rc_context(RC):
        for name in NAMES:
            fig = FIGURES[name]()
            for fmt in ("svg", "png") if png else ("svg",):
                path = out / f"{name}.{fmt}"
                tmp = path.with_name(path.name + ".partial")
                fig.savefig(tmp, format=fmt, metadata=({"Date": None} if fmt == "svg" else None), dpi=110)
                os.replace(tmp, path)
                if fmt == "svg":
                    written.append(path)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="folder for the SVGs (docs/img)")
    ap.add_argument("--png", action="store_true", help="also write PNGs, to look at (not committed)")
    args = ap.parse_args()
    for path in write(args.out, args.png):
        print(path)


if __name__ == "__main__":
    main()
