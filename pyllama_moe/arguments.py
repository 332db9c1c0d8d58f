"""Argument types that check a number or a path while arguments are read, so that bad input is one line from
argparse (exit 2) before any work; and the check that an output would not overwrite an input. The bottom layer:
verbs registered by lower layers (plot, profile, server-soak) use them too."""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path
from typing import Callable

from pyllama_moe.errors import UserError


# ---- numbers ---------------------------------------------------------------------------------------------------

def range_text(low, high, low_open: bool = False, high_open: bool = False) -> str:
    below = None if low is None else (f"more than {low}" if low_open else f"at least {low}")
    above = None if high is None else (f"less than {high}" if high_open else f"at most {high}")
    if below and above and not (low_open or high_open):
        return f"{low} to {high}"
    return " and ".join(part for part in (below, above) if part)


def outside_range(value, low, high, low_open: bool = False, high_open: bool = False) -> bool:
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    return too_low or too_high


def whole_number(noun: str, low: int | None = None, high: int | None = None, note: str = "") -> Callable[[str], int]:
    """An argparse type: an int from low to high, else one line naming the value, what it should be and the range
    (`-5 is not a MiB count (at least 0)`); `note` says what a special value means or why one is refused."""
    rule = range_text(low, high) + (f"; {note}" if note else "")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun} (a whole number, {rule})") from None
        if outside_range(value, low, high):
            raise argparse.ArgumentTypeError(f"{value} is not {noun} ({rule})")
        return value

    parse.__name__ = noun
    return parse


def real_number(noun: str, low: float | None = None, high: float | None = None, *, low_open: bool = False,
                high_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float within the range (open ends where said), else one line as whole_number's."""
    rule = range_text(low, high, low_open, high_open)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun} (a number, {rule})") from None
        if not math.isfinite(value) or outside_range(value, low, high, low_open, high_open):
            raise argparse.ArgumentTypeError(f"{text} is not {noun} ({rule})")
        return value

    parse.__name__ = noun
    return parse


def count(noun: str) -> Callable[[str], int]:
    """A count of things of which one at least is needed: rounds, tokens, slots..."""
    return whole_number(noun, 1)


def seconds(noun: str = "a time in seconds") -> Callable[[str], float]:
    return real_number(noun, 0, low_open=True)


MIB = whole_number("a MiB count", 0)
SEED = whole_number("a seed", 0)
# llama.cpp's -t 0 (as any -t <= 0 there) means every hardware thread: the same here, where a thread count is
# passed to llama.cpp; below 0 is refused rather than guessed
LLAMA_THREADS = whole_number("a thread count", 0, note="0: all cores, as llama.cpp's -t 0")


def threads_or_all(value: int | None, default: int) -> int:
    """A thread count as llama.cpp reads -t: 0 is every core; None (not given) is `default`."""
    if value == 0:
        return os.cpu_count() or 1
    return default if value is None else value


def choice_list(noun: str, choices: tuple[str, ...]) -> Callable[[str], str]:
    """An argparse type: comma-separated names, each one of `choices` (kept as the string the verb splits)."""
    def parse(text: str) -> str:
        for item in text.split(","):
            if item not in choices:
                raise argparse.ArgumentTypeError(f"{item!r} in {text!r} is not {noun} (one of: {', '.join(choices)})")
        return text

    parse.__name__ = noun
    return parse


# ---- the expert cache's miss policy ----------------------------------------------------------------------------

# llama-moe.h's enum llama_moe_miss_policy, and the largest N of split:N (llama-moe.cpp)
MISS_UPLOAD, MISS_CPU, MISS_SPLIT = 0, 1, 2
MISS_SPLIT_MAX = 4096
MISS_POLICY_RULE = f"upload, cpu or split:N with N 1 to {MISS_SPLIT_MAX}"
_MISS_SPLIT = re.compile(r"split:([0-9]{1,6})")


def parse_miss_policy(text) -> tuple[int, int] | None:
    """The spelling llama_moe_parse_miss_policy takes ("upload", "cpu", "split:N"), as (kind, n), or None. Kept here as
    well so that a value is refused before any build exists to parse it."""
    if not isinstance(text, str):
        return None
    if text in ("upload", "cpu"):
        return (MISS_UPLOAD if text == "upload" else MISS_CPU), 0
    match = _MISS_SPLIT.fullmatch(text)
    if match and 1 <= int(match.group(1)) <= MISS_SPLIT_MAX:
        return MISS_SPLIT, int(match.group(1))
    return None


def miss_policy(text: str) -> str:
    """An argparse type: a miss policy, kept as the text (what the environment variable takes)."""
    if parse_miss_policy(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a miss policy ({MISS_POLICY_RULE})")
    return text


# ---- paths -----------------------------------------------------------------------------------------------------

def _path_type(noun: str, problem: Callable[[Path], str | None], stdout_dash: bool = False) -> Callable[[str], Path]:
    """An argparse type for a path: `problem` says what is wrong with it (None: nothing), after the path in
    argparse's one line; `-` passes as itself where it means stdout."""
    def parse(text: str) -> Path:
        if stdout_dash and text == "-":
            return text
        why = problem(Path(text))
        if why:
            raise argparse.ArgumentTypeError(f"{text} {why}")
        return Path(text)

    parse.__name__ = noun
    return parse


def input_file(noun: str) -> Callable[[str], Path]:
    """An argparse type: an existing, readable file."""
    def problem(path: Path) -> str | None:
        if not path.exists():
            return f"does not exist (the {noun} to read)"
        if not path.is_file():
            return f"is not a file (the {noun} to read)"
        return None if os.access(path, os.R_OK) else f"is not readable (the {noun} to read)"

    return _path_type(noun, problem)


def input_dir(noun: str) -> Callable[[str], Path]:
    """An argparse type: an existing folder."""
    def problem(path: Path) -> str | None:
        if path.is_dir():
            return None
        return f"{'is not a folder' if path.exists() else 'does not exist'} (the {noun})"

    return _path_type(noun, problem)


def output_file(noun: str, stdout_dash: bool = False) -> Callable[[str], Path]:
    """An argparse type: a file that can be written: not a folder, in an existing folder that is writable (checked
    before any work, so a long run does not end in a traceback at its last step); `-` for stdout where allowed."""
    def problem(path: Path) -> str | None:
        if path.is_dir():
            return f"is a folder (the {noun} to write: give a file name)"
        return _folder_problem(path.parent, create=False)

    return _path_type(noun, problem, stdout_dash)


def output_dir(noun: str) -> Callable[[str], Path]:
    """An argparse type: a folder made when missing: not a file, and its nearest existing folder writable."""
    def problem(path: Path) -> str | None:
        if path.exists() and not path.is_dir():
            return f"is a file (the {noun}: give a folder, made when missing)"
        return _folder_problem(path, create=True)

    return _path_type(noun, problem)


def _folder_problem(folder: Path, create: bool) -> str | None:
    """What keeps a file from being written in `folder` (with `create`, in folders made below its nearest one)."""
    folder = Path(os.path.abspath(folder))
    if create:  # the nearest folder that exists is where the missing ones will be made
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
    if not folder.exists():
        return f"is in folder {folder}, which does not exist (create it first)"
    if not folder.is_dir():
        return f"is below {folder}, which is not a folder"
    return None if os.access(folder, os.W_OK | os.X_OK) else f"is in folder {folder}, which is not writable"


def refuse_overwrite(outputs: dict[str, Path | str | None], inputs: dict[str, Path | str | None]) -> None:
    """An output that is one of the inputs would be lost when the output is written: refuse before any work."""
    for out_flag, out in outputs.items():
        if out is None or out == "-":
            continue
        for in_flag, given in inputs.items():
            if given is not None and os.path.abspath(out) == os.path.abspath(given):
                raise UserError(f"{out_flag} {out} is also the {in_flag}: writing it would overwrite that input",
                                f"give {out_flag} another file")
