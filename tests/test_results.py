"""results/ is the product's record, one Markdown file per capability: nothing in it is named or headed by when it was
made (a session, a sitting, an issue number), results/README.md lists every capability file, and every data file is
named by a current text (a file no text cites is a leftover of a superseded run). Reads files only; builds nothing."""
import re
from pathlib import Path

from pyllama_moe.paths import PROJECT_ROOT

RESULTS = PROJECT_ROOT / "results"

# what a results name or heading may not say: a sitting's number as a name part (`sN`), the words session or
# sitting, or an issue's number
WHEN = re.compile(r"session|sitting|issue[ _-]?\d|(?<![a-z0-9])s\d+(?![a-z0-9])", re.I)
# in running text a word may be legitimate elsewhere (an HTTP session), but not in these files
WHEN_TEXT = re.compile(r"\bsession|\bsitting\b|\bissue \d", re.I)


def misnamed(root: Path) -> list[str]:
    """Names under root, and Markdown headings, that say when a result was made instead of what it measures."""
    bad = [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if WHEN.search(p.name)]
    for md in sorted(root.glob("*.md")):
        for line in md.read_text().splitlines():
            if line.startswith("#") and WHEN.search(line):
                bad.append(f"{md.name}: {line}")
            elif WHEN_TEXT.search(line):
                bad.append(f"{md.name}: {line.strip()[:100]}")
    return bad


def uncited(root: Path) -> list[str]:
    """Data files and folders directly under root that no Markdown file there names."""
    texts = "\n".join(md.read_text() for md in root.glob("*.md"))
    return [p.name for p in sorted(root.iterdir()) if p.suffix != ".md" and p.name not in texts]


def test_nothing_in_results_is_named_or_headed_by_when_it_was_made():
    assert not misnamed(RESULTS)


def test_the_check_sees_a_name_and_a_heading_that_say_when(tmp_path):
    (tmp_path / "bench-s1-cache-tg128.json").write_text("{}")
    (tmp_path / "s2-logs").mkdir()
    (tmp_path / "tsan-sim-s3.txt").write_text("")
    (tmp_path / "decode.md").write_text("# Issue 1: decode\n\n## Second session (2000-01-01)\n")
    (tmp_path / "prompts.md").write_text("# Prompts\n\nRun in the first session.\n")
    (tmp_path / "prefetch-pp512-tg128-rows.json").write_text("{}")
    (tmp_path / "ok.md").write_text("# pp4096 at ub 512, tg128 at -t 15 (t15), commit 59d8bd5\n\nAn HTTP client.\n")
    got = misnamed(tmp_path)
    assert got == ["bench-s1-cache-tg128.json", "s2-logs", "tsan-sim-s3.txt", "decode.md: # Issue 1: decode",
                   "decode.md: ## Second session (2000-01-01)", "prompts.md: Run in the first session."], got


def test_every_capability_file_is_listed_in_the_results_readme():
    index = (RESULTS / "README.md").read_text()
    missing = [md.name for md in sorted(RESULTS.glob("*.md")) if md.name != "README.md" and f"({md.name})" not in index]
    assert not missing, f"results/README.md lists no link to {missing}"


def test_every_data_file_in_results_is_cited_by_a_current_text():
    assert not uncited(RESULTS), "cite each in the results file that measured it, or delete it (git history keeps it)"


def test_the_relative_links_of_results_files_resolve():
    broken = []
    for md in sorted(RESULTS.glob("*.md")):
        for target in re.findall(r"\]\(([^)#\s]+)\)", md.read_text()):
            if "://" not in target and not (md.parent / target).exists():
                broken.append(f"{md.name} -> {target}")
    assert not broken, broken
