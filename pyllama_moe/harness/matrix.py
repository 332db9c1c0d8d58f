"""The identity matrix: cells read from a TOML file in ci/, expanded from axes, with named subsets.

Every option of a cell is checked, so that a typo in the matrix is an error naming the file and the cell rather
than a cell that silently tests something else. The file's tables: docs/identity.md, "The matrix file".
"""

from __future__ import annotations

import itertools
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from pyllama_moe.errors import UserError
from pyllama_moe.worker.fault import parse_fault

AXES = ("model", "offload", "ubatch", "load", "knobs", "eval_callback", "backend")
# `sim` and `sim2`: the patched CPU build with one or two simulated accelerators (the `sim` test double)
SIM_DEVICES = {"sim": 1, "sim2": 2}
BACKENDS = ("cpu", *SIM_DEVICES, "cuda")
LOADS = ("mmap", "none")
# "divergence": held to the divergence contract (divergence.py) instead of byte identity; "divergence-flagged": a
# negative control of it, a planted fault the contract must flag
DIVERGENCE_EXPECTS = ("divergence", "divergence-flagged")
EXPECTS = ("identical", "mismatch", *DIVERGENCE_EXPECTS)


@dataclass(frozen=True)
class Cell:
    model: str
    offload: str = "cpu-moe"  # all | cpu-moe | ncmoe-N | ngl-N
    # the baseline's placement where it differs (e.g. "all": what a path computing host experts on a GPU must equal),
    # or "by-path": the one the candidate's decode paths name, chosen after the candidate ran (compare.choose_reference)
    baseline_offload: str = ""
    ubatch: int = 512
    load: str = "mmap"
    knobs: str = "off"  # a name from [knobs]: environment for the candidate
    eval_callback: int = 0  # both builds observe every Nth node: the scheduler's chunked compute path (0: none)
    backend: str = "cpu"
    baseline: str = "master"
    candidate: str = "patched"
    baseline_repack: bool = True
    candidate_repack: bool = True
    expect: str = "identical"
    fit: str = "off"
    prompt_tokens: int = 600
    generate: int = 128
    perplexity: bool = True
    ppl_ctx: int = 128
    parallel: int = 1  # sequences decoding together: each decode step is one graph of this many tokens
    # a divergence cell's yardstick, master placed so ("cpu-moe", "ncmoe-N", or "ot:L,L": an -ot rule keeping those
    # layers' experts on the CPU), and the fault planted in its candidate ("layer:L,expert:E,eps:X"; worker/fault.py)
    yardstick: str = ""
    fault: str = ""
    name: str = ""

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        cb = f"/cb{self.eval_callback}" if self.eval_callback else ""
        par = f"/p{self.parallel}" if self.parallel > 1 else ""
        return f"{self.backend}/{self.model}/{self.offload}/ub{self.ubatch}/{self.load}/{self.knobs}{cb}{par}"

    @property
    def build_backend(self) -> str:
        """The backend the builds of this cell are made for: sim devices live in the CPU build."""
        return "cuda" if self.backend == "cuda" else "cpu"

    def placement(self, baseline: bool = False) -> dict:
        """RunSpec fields for the offload column, or for the baseline's where it has one of its own."""
        offload = self.baseline_offload if baseline and self.baseline_offload else self.offload
        if offload == "by-path":
            raise ValueError(f"{self.label}: a by-path baseline is placed by the candidate's paths (compare.py)")
        return offload_placement(offload)

    def yardstick_placement(self) -> dict:
        """RunSpec fields of a divergence cell's yardstick."""
        return offload_placement(self.yardstick)


def offload_placement(offload: str) -> dict:
    """RunSpec fields of an offload value: all | cpu-moe | ncmoe-N | ngl-N | ot:L,L (those layers' experts on the
    CPU)."""
    if offload == "all":
        return {}
    if offload == "cpu-moe":
        return {"cpu_moe": True}
    if offload.startswith("ot:"):
        return {"cpu_moe_layers": [int(il) for il in offload[3:].split(",")]}
    kind, _, n = offload.partition("-")
    return {"n_cpu_moe": int(n)} if kind == "ncmoe" else {"n_gpu_layers": int(n)}


CELL_FIELDS = {f.name: f for f in fields(Cell)}


@dataclass
class Matrix:
    path: Path
    models: dict[str, dict]
    knobs: dict[str, dict[str, str]]
    sim_env: dict[str, str]
    axes: dict[str, list]
    defaults: dict
    subsets: dict[str, dict]
    controls: list[dict] = field(default_factory=list)
    extra: list[dict] = field(default_factory=list)  # [[cells]]

    def cells(self, subset: str | None = None) -> list[Cell]:
        if subset is None or subset == "full":
            combos = self._product()
        elif subset not in self.subsets:
            raise UserError(f"{self.path}: no subset named {subset!r}", f"use one of: full, {', '.join(self.subsets)}")
        else:
            spec = self.subsets[subset]
            combos = self._product(spec.get("where"))
            if spec.get("pairwise"):
                combos = pairwise_cover(combos, [a for a in AXES if a in self.axes])
        where = (self.subsets.get(subset) or {}).get("where") or {}
        cells = [self._cell({**self.defaults, **combo}, f"cell {combo}") for combo in combos]
        cells += [self._cell({**self.defaults, **x}, f"cell {x}") for x in self.extra]
        cells += [self._cell({**self.defaults, **ctl}, f"control {ctl.get('name', '?')}") for ctl in self.controls]
        # a cell belongs to a subset when it matches the subset's filter on every option it names, axes or not (a
        # product cell's axes matched already)
        return [c for c in cells if all(getattr(c, a) in vals for a, vals in where.items())]

    def _product(self, where: dict | None = None) -> list[dict]:
        names = [a for a in AXES if a in self.axes]
        values = [[v for v in self.axes[a] if not where or a not in where or v in where[a]] for a in names]
        return [dict(zip(names, combo)) for combo in itertools.product(*values)]

    def _cell(self, options: dict, where: str) -> Cell:
        for key in options:
            if key not in CELL_FIELDS:
                raise UserError(f"{self.path}: {where} has unknown option {key!r}",
                                f"use one of: {', '.join(sorted(CELL_FIELDS))}")
        cell = Cell(**options)
        if cell.backend in SIM_DEVICES:
            # weights a device's host buffer holds are never repacked, so master on the CPU must not repack
            # either for the two to compute the same thing (architecture doc, section 5)
            cell = replace(cell, baseline_repack=False, candidate_repack=False)
        self._check(cell, where)
        return cell

    def _check(self, cell: Cell, where: str) -> None:
        def bad(what: str, allowed) -> UserError:
            return UserError(f"{self.path}: {where}: {what}", f"use one of: {', '.join(map(str, allowed))}")

        if cell.model not in self.models:
            raise bad(f"unknown model {cell.model!r}", self.models)
        if cell.knobs not in self.knobs:
            raise bad(f"unknown knobs {cell.knobs!r}", self.knobs)
        if cell.backend not in BACKENDS:
            raise bad(f"unknown backend {cell.backend!r}", BACKENDS)
        if cell.load not in LOADS:
            raise bad(f"unknown load mode {cell.load!r}", LOADS)
        if cell.expect not in EXPECTS:
            raise bad(f"unknown expect {cell.expect!r}", EXPECTS)
        for variant in (cell.baseline, cell.candidate):
            if variant not in ("master", "patched"):
                raise bad(f"unknown build {variant!r}", ("master", "patched"))
        if cell.backend in SIM_DEVICES and cell.candidate != "patched":
            raise bad(f"a {cell.backend} cell needs the patched build as candidate, not {cell.candidate!r}", ("patched",))
        placed = cell.baseline_offload if cell.baseline_offload != "by-path" else ""
        for offload in filter(None, (cell.offload, placed)):
            kind, _, n = offload.partition("-")
            if offload not in ("all", "cpu-moe") and not (kind in ("ncmoe", "ngl") and n.isdigit()):
                raise bad(f"unknown offload {offload!r}", ("all", "cpu-moe", "ncmoe-N", "ngl-N"))
        if cell.baseline_offload == "by-path":
            # the reference keeps on the CPU the candidate's host experts that left the banks: only experts are on
            # the host (-ngl would put whole layers there), and only the patched build reports the paths
            if cell.candidate != "patched" or cell.backend == "cpu":
                raise bad("a by-path baseline needs the patched build on a GPU-like backend as candidate",
                          ("sim", "sim2", "cuda"))
            if not (cell.offload == "cpu-moe" or cell.offload.startswith("ncmoe-")):
                raise bad(f"a by-path baseline needs the candidate's experts on the host, not {cell.offload!r}",
                          ("cpu-moe", "ncmoe-N"))
        self._check_divergence(cell, bad)
        if not isinstance(cell.parallel, int) or cell.parallel < 1:
            raise bad(f"parallel {cell.parallel!r} is not a whole number of sequences", (1, 2, 4, 8))
        if cell.fit not in ("on", "off"):
            raise bad(f"unknown fit {cell.fit!r}", ("on", "off"))


    @staticmethod
    def _check_divergence(cell: Cell, bad) -> None:
        """A divergence cell names its yardstick, decodes one sequence (teacher-forced, step by step) and takes no
        other eval callback than its fault's; yardstick and fault belong to divergence cells only."""
        if cell.expect not in DIVERGENCE_EXPECTS:
            if cell.yardstick or cell.fault:
                raise bad("yardstick and fault belong to a divergence cell", DIVERGENCE_EXPECTS)
            return
        valid = cell.yardstick in ("all", "cpu-moe") or re.fullmatch(r"(ncmoe|ngl)-\d+|ot:\d+(,\d+)*", cell.yardstick)
        if not valid:
            raise bad(f"a divergence cell's yardstick {cell.yardstick!r} is no placement",
                      ("cpu-moe", "ncmoe-N", "ngl-N", "ot:L,L"))
        if cell.baseline_offload == "by-path" or cell.parallel != 1:
            raise bad("a divergence cell has one reference and one sequence", ("baseline_offload = \"all\"",))
        if cell.fault:
            try:
                parse_fault(cell.fault)
            except ValueError as exc:
                raise bad(str(exc), ("layer:L,expert:E,eps:X",)) from None
            if cell.eval_callback:
                raise bad("a planted fault is the run's one eval callback: eval_callback must be 0", (0,))


def pairwise_cover(combos: list[dict], axes: list[str]) -> list[dict]:
    """A greedy subset of `combos` covering every (axis a = x, axis b = y) pair that occurs in `combos`."""
    def pairs(combo: dict) -> set:
        return {(a, combo[a], b, combo[b]) for a, b in itertools.combinations(axes, 2)}

    uncovered = set().union(*(pairs(c) for c in combos)) if combos else set()
    chosen = []
    while uncovered:
        best = max(combos, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


def load_matrix(path: Path) -> Matrix:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise UserError(f"matrix file {path} does not exist", "pass one of the files in ci/ (e.g. ci/matrix.toml)") from exc
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"matrix file {path} is not valid TOML ({exc})", "fix the syntax") from exc
    known = {"models", "knobs", "sim", "axes", "defaults", "subsets", "cells", "controls"}
    unknown = set(data) - known
    if unknown:
        raise UserError(f"{path}: unknown section(s) {', '.join(sorted(unknown))}", f"use: {', '.join(sorted(known))}")
    axes = data.get("axes", {})
    for axis in axes:
        if axis not in AXES:
            raise UserError(f"{path}: unknown axis {axis!r}", f"use one of: {', '.join(AXES)}")
    knobs = {"off": {}, **data.get("knobs", {})}
    return Matrix(path, data.get("models", {}), knobs, {k: str(v) for k, v in data.get("sim", {}).items()}, axes, data.get("defaults", {}), data.get("subsets", {}),
                  data.get("controls", []), data.get("cells", []))
