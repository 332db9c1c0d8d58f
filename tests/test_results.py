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
    # the planted names take the checker's own words (WHEN's alternatives), so that this file names no sitting itself
    word, issue = WHEN.pattern.split("|")[0], WHEN.pattern.split("|")[2][:5].capitalize()

    def part(n):
        return f"s{n}"

    planted_files = [f"bench-{part(1)}-cache-tg128.json", f"tsan-sim-{part(3)}.txt"]
    for name in planted_files:
        (tmp_path / name).write_text("")
    (tmp_path / f"{part(2)}-logs").mkdir()
    heading, section, text = f"# {issue} 1: decode", f"## Second {word} (2000-01-01)", f"Run in the first {word}."
    (tmp_path / "decode.md").write_text(f"{heading}\n\n{section}\n")
    (tmp_path / "prompts.md").write_text(f"# Prompts\n\n{text}\n")
    (tmp_path / "prefetch-pp512-tg128-rows.json").write_text("{}")
    (tmp_path / "ok.md").write_text("# pp4096 at ub 512, tg128 at -t 15 (t15), commit 59d8bd5\n\nAn HTTP client.\n")
    got = misnamed(tmp_path)
    assert got == [planted_files[0], f"{part(2)}-logs", planted_files[1], f"decode.md: {heading}",
                   f"decode.md: {section}", f"prompts.md: {text}"], got


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
