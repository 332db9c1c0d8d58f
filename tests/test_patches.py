import re
import shutil

import pytest

from pyllama_moe.errors import UserError
from pyllama_moe.paths import PATCHES_DIR, SERIES_FILE
from pyllama_moe.source import patches
from pyllama_moe.source.pin import load_pin


def _copy_series(tmp_path):
    out = tmp_path / "patches"
    shutil.copytree(PATCHES_DIR, out)
    return out, out / "series"


def test_series_check_passes(src):
    assert patches.check(src.llama_dir, load_pin().label) == []


def test_check_names_the_patch_and_file_that_no_longer_applies(src, tmp_path):
    pdir, series = _copy_series(tmp_path)
    first = patches.read_series(series, pdir)[0]
    text = first.path.read_text()
    # break a context line of the first hunk so it cannot apply
    head, hunk = text.split("\n@@", 1)
    header_line, hunk = hunk.split("\n", 1)
    head += "\n@@" + header_line
    hunk = re.sub(r"^ (\S.*)$", lambda m: " " + m.group(1) + " # drifted", hunk, count=1, flags=re.M)
    broken = head + "\n" + hunk
    assert broken != text
    first.path.write_text(broken)
    problems = patches.check(src.llama_dir, load_pin().label, pdir, series)
    assert len(problems) == 1
    assert first.name in problems[0] and "does not apply" in problems[0]
    touched = patches._touched_files(text.encode())
    assert any(f in problems[0] for f in touched)


def test_check_fails_when_export_would_change_a_file(src, tmp_path):
    pdir, series = _copy_series(tmp_path)
    first = patches.read_series(series, pdir)[0]
    text = first.path.read_text()
    # abbreviated blob ids still apply, but the export writes full ones
    stale = re.sub(r"^index ([0-9a-f]{12})[0-9a-f]+\.\.([0-9a-f]{12})[0-9a-f]+", r"index \1..\2", text, flags=re.M)
    assert stale != text
    first.path.write_text(stale)
    problems = patches.check(src.llama_dir, load_pin().label, pdir, series)
    assert problems == [f"{first.name}: export would change the file (run `pyllama-moe patches export`)"]


def test_check_flags_unlisted_patch_files(src, tmp_path):
    pdir, series = _copy_series(tmp_path)
    (pdir / "stray.patch").write_text("x")
    problems = patches.check(src.llama_dir, load_pin().label, pdir, series)
    assert any("stray.patch: not listed" in p for p in problems)


def test_audit_requires_trailers_and_a_reason():
    mail = b"From 0 Mon Sep 17 00:00:00 2001\nSubject: sched: do a thing\n\nBecause.\n\nReason: behaviour-only\nLogits-Neutral: yes\n---\n"
    assert patches.audit_mail("a.patch", mail) == []
    no_trailer = mail.replace(b"Reason: behaviour-only\nLogits-Neutral: yes\n", b"")
    problems = patches.audit_mail("a.patch", no_trailer)
    assert any("Reason:" in p for p in problems) and any("Logits-Neutral" in p for p in problems)


def test_apply_then_export_round_trips(src, tmp_path):
    scratch = patches.apply_scratch(src.llama_dir, tmp_path / "scratch", load_pin().label)
    mails = patches.export_mails(scratch)
    series = patches.read_series()
    assert list(mails) == [p.name for p in series]
    assert all(mails[p.name] == p.read() for p in series)
    # native/ is overlaid but ignored by git, so it never leaks into an exported patch
    status = patches._git(["status", "--porcelain"], scratch).stdout.decode()
    assert status == ""
    assert (scratch / "include/llama-moe.h").is_file()
    with pytest.raises(UserError, match="already exists"):
        patches.apply_scratch(src.llama_dir, scratch, load_pin().label)


def test_missing_patch_in_series_is_named(tmp_path):
    series = tmp_path / "series"
    series.write_text("# comment\nnope.patch\n")
    with pytest.raises(UserError, match=r"series:2: patch nope.patch does not exist"):
        patches.read_series(series, tmp_path)


def test_series_file_is_the_real_one():
    assert SERIES_FILE.is_file()
