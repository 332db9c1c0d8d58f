"""tools/docs_figures.py: both pictures of docs/expert-cache.md are drawn, the same bytes on every run, and the
committed ones are what the script draws now (so an edit of the script comes with its pictures)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "docs_figures.py"
NAMES = ("expert-cache-data-path.svg", "decode-step.svg")

pytest.importorskip("matplotlib")


def _draw(out: Path) -> dict[str, bytes]:
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True, cwd=ROOT, capture_output=True,
                   env={**os.environ, "MPLBACKEND": "Agg"})
    return {name: (out / name).read_bytes() for name in NAMES}


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    return _draw(tmp_path_factory.mktemp("one")), _draw(tmp_path_factory.mktemp("two"))


def test_both_pictures_are_svg_with_text_as_text(drawn):
    first, _ = drawn
    for name, data in first.items():
        text = data.decode()
        assert text.lstrip().startswith("<?xml") and "<svg" in text, name
        assert "<text" in text, f"{name}: text drawn as paths (svg.fonttype is not 'none')"
        assert "<dc:date>" not in text, f"{name}: carries a date"
        assert len(data) < 200_000, f"{name}: {len(data)} bytes"
    assert "schematic, not to scale" in first["decode-step.svg"].decode()


def test_two_runs_give_the_same_bytes(drawn):
    first, second = drawn
    for name in NAMES:
        assert first[name] == second[name], f"{name} differs between two runs"


def test_committed_pictures_match_the_script(drawn):
    import matplotlib

    first, _ = drawn
    for name in NAMES:
        committed = (ROOT / "docs" / "img" / name).read_bytes()
        made_with = re.search(rb"Matplotlib v([^,<]+)", committed)
        if made_with and made_with.group(1).decode() != matplotlib.__version__:
            pytest.skip(f"docs/img/{name} was drawn by matplotlib {made_with.group(1).decode()}, this is "
                        f"{matplotlib.__version__}: its bytes may differ without a change of the script")
        assert committed == first[name], (f"docs/img/{name} is not what tools/docs_figures.py draws: run "
                                          "`python3 tools/docs_figures.py` and commit the pictures")
