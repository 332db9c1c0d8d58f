"""The package's layers: a module imports only its own layer or lower ones, and no modules import each other in a circle.

Every import counts, also one inside a function: the import graph is read from the source with `ast`, nothing is
imported. A module's layer is LAYERS of its first two name parts (`pyllama_moe.bench.rounds` -> `pyllama_moe.bench`),
so a new top-level module or subpackage fails here until it is given a layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "pyllama_moe"

LAYERS = {  # bottom to top
    "pyllama_moe": 0,  # the package's __init__
    "pyllama_moe.errors": 0,
    "pyllama_moe.paths": 0,
    "pyllama_moe.progress": 0,
    "pyllama_moe.arguments": 0,  # argparse types that check numbers and paths
    "pyllama_moe.source": 1,  # pin, sdist, patches, trees, packs
    "pyllama_moe.build": 2,  # builder, info, ffi
    "pyllama_moe.worker": 3,  # the child process that drives llama.cpp
    "pyllama_moe.synth": 4,  # synthetic models
    "pyllama_moe.bench": 5,  # A/B benchmarks
    "pyllama_moe.harness": 6,  # identity matrix, runs, cached models, server soak
    "pyllama_moe.plot": 7,  # pictures and profiles
    "pyllama_moe.llm": 8,  # the public Python API
    "pyllama_moe.cli": 9,
    "pyllama_moe.__main__": 9,
}


def modules(package_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package by its __init__.py)."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = (package_dir.name, *path.relative_to(package_dir).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported module) of every import of this package in one module. `from P import n` imports P.n where
    that is a module, else P; an import of a name that is no module of the package is kept as it is written, for
    test_every_import_names_a_module to report."""
    root = name.split(".")[0]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == root]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if module.split(".")[0] != root:
                continue
            out += [(node.lineno, f"{module}.{a.name}" if f"{module}.{a.name}" in known else module)
                    for a in node.names]
    return out


def graph(package_dir: Path = PACKAGE_DIR) -> tuple[dict[str, Path], dict[str, list[tuple[int, str]]]]:
    known = modules(package_dir)
    return known, {name: imports(name, path, known) for name, path in known.items()}


def layer(name: str) -> int | None:
    return LAYERS.get(".".join(name.split(".")[:2]))


def layer_violations(edges: dict[str, list[tuple[int, str]]]) -> list[str]:
    return [f"{name}:{line} imports {target} (layer {layer(target)} above its own {layer(name)})"
            for name, found in edges.items() for line, target in found
            if layer(name) is not None and layer(target) is not None and layer(target) > layer(name)]


def cycle(edges: dict[str, list[tuple[int, str]]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    targets = {name: sorted({t for _, t in found if t in edges and t != name}) for name, found in edges.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for target in targets[name]:
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[name] = 2
        return None

    for name in sorted(edges):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_every_module_has_a_layer():
    known, _ = graph()
    assert len(known) > 40, f"found only {len(known)} modules under {PACKAGE_DIR}"
    assert [name for name in known if layer(name) is None] == [], "give these a layer in LAYERS"


def test_every_import_names_a_module():
    known, edges = graph()
    missing = [f"{name}:{line} imports {target}" for name, found in edges.items() for line, target in found
               if target not in known]
    assert missing == []


def test_no_module_imports_a_layer_above_its_own():
    _, edges = graph()
    assert "pyllama_moe.build.builder" in {t for _, t in edges.get("pyllama_moe.cli.main", [])}  # imported inside a function
    assert layer_violations(edges) == []


def test_no_import_circle():
    _, edges = graph()
    found = cycle(edges)
    assert found is None, " -> ".join(found)


def test_the_checks_find_a_planted_upward_import_and_circle(tmp_path):
    pkg = tmp_path / "pyllama_moe"
    for rel, text in {"__init__.py": "", "errors.py": "", "bench/__init__.py": "", "cli/__init__.py": "",
                      "bench/rounds.py": "def f():\n    from pyllama_moe.cli import args\n",
                      "cli/main.py": "from ..errors import UserError\nfrom . import args\n",
                      "cli/args.py": "import pyllama_moe.cli.main\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    _, edges = graph(pkg)
    assert edges["pyllama_moe.cli.main"] == [(1, "pyllama_moe.errors"), (2, "pyllama_moe.cli.args")]
    assert layer_violations(edges) == ["pyllama_moe.bench.rounds:2 imports pyllama_moe.cli.args (layer 9 above its own 5)"]
    assert cycle(edges) == ["pyllama_moe.cli.args", "pyllama_moe.cli.main", "pyllama_moe.cli.args"]
