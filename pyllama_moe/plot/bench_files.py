"""The files the pictures read: `pyllama-moe bench --json` output and llama-bench's own `-o json`.

Apart from main.py, which imports hits.py and sweep.py, so that they read these files without importing it back."""

from __future__ import annotations

import json
import math
from pathlib import Path

from pyllama_moe.errors import UserError

SCHEMAS = (1, 2)
NOT_BENCH = "is not the JSON of `pyllama-moe bench --json`"
NOT_BENCH_FIX = "pass the files that bench wrote with --json"


def llama_bench_records(path: Path) -> list[dict] | None:
    """The records of a llama-bench `-o json` file (one build's output, not a `bench --json` file), or None if it is not
    one (then `_read_file` says what is wrong with it)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(data, list) and data and all(isinstance(r, dict) and "samples_ts" in r for r in data)):
        return None
    return data


def _read_file(path: Path, normalize: bool = True) -> tuple[dict, list[dict]]:
    """Meta and tests of one bench file, refused with one message if it is not one; the tests normalized
    (see `_normalize`) or, for the samples picture, as written."""
    try:
        data = json.loads(path.read_text())
        meta = data.get("meta") or {}
        if not isinstance(meta, dict) or not isinstance(data["tests"], list):
            raise TypeError("meta must be an object and tests a list")
        schema = meta.get("schema", 1)  # schema 1 files have no schema field
        if schema not in SCHEMAS:
            raise UserError(f"{path} has schema {schema!r}; this plot knows {SCHEMAS}",
                            "update pyllama_moe to the version of the bench that wrote it")
        return meta, [_normalize(t, path) for t in data["tests"]] if normalize else data["tests"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"{path} {NOT_BENCH} ({exc})", NOT_BENCH_FIX) from exc


def _normalize(t: dict, path: Path) -> dict:
    """One shape for both schemas: every field below is present, None where the file does not say.

    Only what the picture uses is kept (not the samples).
    """
    if not isinstance(t.get("test"), str):
        raise TypeError(f"a test without a label: {str(t)[:80]}")
    base, cand = _number(t, "median_baseline"), _number(t, "median_candidate")
    if base is not None and base <= 0 or cand is not None and cand <= 0:
        base = cand = None  # zero t/s has no ratio and no place on a log axis; treated like a missing side
    ratio = _number(t, "ratio")
    if ratio is None and base and cand:
        ratio = cand / base  # schema 2 leaves it null without pairs; the medians' ratio is the best left
    low, high = _number(t, "ci_low"), _number(t, "ci_high")
    if (low is None) != (high is None) or low is not None and low > high:
        raise ValueError(f"{t['test']}: interval [{low}, {high}] is not an interval")
    n_pairs = t.get("n_pairs")
    if n_pairs is not None and n_pairs < 2:
        low = high = None  # an interval of one pair is not one
    converged = t.get("converged")
    if converged not in (None, True, False):
        raise TypeError(f"{t['test']}: converged is {converged!r}, not true, false or null")
    return {"test": t["test"], "file": str(path), "median_baseline": base, "median_candidate": cand,
            "ratio": ratio, "ci_low": low, "ci_high": high, "n_pairs": n_pairs, "converged": converged,
            "limit": _limit(t.get("limit"), t["test"])}


def _limit(limit, label: str) -> dict | None:
    if limit is None:
        return None
    if not isinstance(limit, dict):
        raise TypeError(f"{label}: limit is {limit!r}, not an object")
    fields = ("share_candidate", "share_low", "share_high", "share_baseline")
    out = {"row": limit.get("row"), **{k: _number(limit, k) for k in fields}}
    return out if out["share_candidate"] is not None else None


def _number(d: dict, key: str) -> float | None:
    value = d.get(key)
    if value is None:
        return None
    # bool is an int to Python, but `true` where a number belongs is a broken file
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} is {value!r}, not a number")
    return float(value)
