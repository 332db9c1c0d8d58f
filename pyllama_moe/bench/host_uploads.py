"""Host-weight uploads beside bench rows: what a row's repetitions moved over PCIe for the weights kept in host memory.

A prompt row whose experts stay on the host is bound by those uploads as much as by its compute, and whether a
setting (layer-major prompts, staged groups, the ubatch) changes its speed by uploading less, or some other way,
shows only beside them. The patched llama-bench reports, per repetition, the bytes the prefetch uploaded ahead of
their splits and those it found kept on the device instead; a row's figure is the mean over the repetitions its
timing keeps. See docs/benchmarks.md, "Host-upload columns".
"""

from __future__ import annotations

import statistics

from pyllama_moe.bench.rounds import BenchResult, BenchRow, per_side


def side_host_uploads(row: BenchRow, side: str) -> dict | None:
    """The mean bytes uploaded and found kept per kept repetition of one side of a row; None where the build reported
    none (nothing on the host, or an unpatched llama-bench)."""
    kept = [s for s in row.samples if s.side == side and not s.discarded and s.host_upload_bytes is not None]
    if not kept:
        return None
    return {"upload_bytes": statistics.fmean(s.host_upload_bytes for s in kept),
            "kept_bytes": statistics.fmean(s.host_kept_bytes or 0 for s in kept), "repetitions": len(kept)}


def host_uploads(result: BenchResult) -> dict[str, dict]:
    """Per row label with host uploads on some side: {"host_uploads": {side: side_host_uploads}} (the JSON's rows)."""
    return per_side(result, side_host_uploads, "host_uploads")


def host_upload_columns(uploads: dict[str, dict], names: dict[str, str]) -> dict[str, dict[str, str]]:
    """Table columns: per side, the GiB uploaded per repetition and, where any, those found kept."""
    cols: dict[str, dict[str, str]] = {}
    for label, entry in uploads.items():
        for side, h in entry["host_uploads"].items():
            kept = f" ({h['kept_bytes'] / 2**30:.2f} kept)" if h["kept_bytes"] > 0 else ""
            cols.setdefault(label, {})[f"host GiB up, {names[side]}"] = f"{h['upload_bytes'] / 2**30:.2f}{kept}"
    return cols
