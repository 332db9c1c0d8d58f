"""What a bench row is measured against: another row of the same run (`--limit-row`, `--limit-from baseline`), the
PCIe bound of its host weights (`--pcie-bound`), or, for a decode row with an expert cache, its limit row plus its
misses' bytes over the link (`--pcie-bound` with `--limit-row`).

A share is computed per llama-bench process, whose row and limit share its placement, and gets an interval as a
ratio does. See docs/benchmarks.md, "Limit rows and the PCIe bound".
"""

from __future__ import annotations

import functools
import json
import math
import re
import statistics
import subprocess
from pathlib import Path

from pyllama_moe.bench import stats
from pyllama_moe.bench.rounds import SIDES, TEST_FIELDS, BenchResult, BenchRow
from pyllama_moe.build.builder import Build
from pyllama_moe.errors import UserError
from pyllama_moe.progress import say

# llama-bench's short flags, accepted as field names of --limit-row
FIELD_ALIASES = {"ngl": "n_gpu_layers", "ncmoe": "n_cpu_moe", "ub": "n_ubatch", "b": "n_batch", "lm": "load_mode",
                 "p": "n_prompt", "n": "n_gen", "t": "n_threads", "d": "n_depth", "fa": "flash_attn"}
PROBE = "llama-moe-copy-probe"
BENCH_TARGETS = {"master": ("llama-bench",), "patched": ("llama-bench", PROBE)}
# ggml's default GGML_OP_OFFLOAD_MIN_BATCH: below it, host weights are used where they are, not uploaded
OFFLOAD_MIN_BATCH = 32
PROBE_TIMEOUT_S = 120.0


def parse_limit_row(spec: str) -> tuple[str, str]:
    name, sep, value = spec.partition("=")
    field = FIELD_ALIASES.get(name.strip(), name.strip())
    if not sep or field not in TEST_FIELDS or not value.strip():
        raise UserError(f"--limit-row {spec!r} is not FIELD=VALUE with a llama-bench field",
                        "e.g. --limit-row n_cpu_moe=0 (or ncmoe=0); fields: " + ", ".join(TEST_FIELDS))
    return field, value.strip()


def _same_value(a, b: str) -> bool:
    if isinstance(a, bool):  # llama-bench writes booleans as JSON true/false; people write 0/1
        return b.lower() in (("1", "true") if a else ("0", "false"))
    return str(a).lower() == b.lower()


def find_limit(rows: list[BenchRow], row: BenchRow, field: str, value: str) -> BenchRow | None:
    if _same_value(row.fields.get(field), value):
        return None  # the row is a limit itself
    for other in rows:
        if _same_value(other.fields.get(field), value) and all(
                other.fields.get(f) == row.fields.get(f) for f in TEST_FIELDS if f != field):
            return other
    return None


LIMIT_FROM = ("own", "baseline")


def limit_shares(result: BenchResult, field: str, value: str, limit_from: str = "own") -> dict[str, dict]:
    """Per row label: {"limit": {...}} with each build's share of its own limit row, as an interval; with
    limit_from "baseline" the candidate's share is of the baseline's limit row (paired by round)."""
    if limit_from not in LIMIT_FROM:
        raise UserError(f"--limit-from {limit_from!r} is not one of {', '.join(LIMIT_FROM)}",
                        "use own (each build against its own row) or baseline")
    rows = list(result.rows.values())
    out = {}
    for row in rows:
        limit = find_limit(rows, row, field, value)
        if limit is None:
            continue
        entry: dict = {"row": limit.label, "limit_from": limit_from}
        for side in SIDES:
            limit_side = "baseline" if limit_from == "baseline" else side
            mine, theirs = row.block_means(side), limit.block_means(limit_side)
            iv = stats.paired_ratio_interval([(theirs[r], mine[r]) for r in sorted(mine) if r in theirs])
            entry[f"share_{side}"] = iv.ratio if iv else None
            entry[f"share_{side}_low"] = iv.low if iv else None
            entry[f"share_{side}_high"] = iv.high if iv else None
        # the names plot and readers expect for the candidate's interval
        entry["share_low"], entry["share_high"] = entry["share_candidate_low"], entry["share_candidate_high"]
        out[row.label] = {"limit": entry}
    return out


@functools.lru_cache(maxsize=None)  # the JSON and the table are rewritten every round; the header is read once
def host_upload_bytes(model: Path, n_cpu_moe: int, n_gpu_layers: int) -> int:
    """Bytes of matrix weights in host memory that a large ubatch uploads: the experts of the first
    `n_cpu_moe` layers and every matrix of the layers `-ngl` leaves on the CPU (llama.cpp counts the output
    layer as one of the `-ngl` layers; a negative `-ngl`, llama-bench's default -1, means all on the GPU).
    The output matrix is left out even with `-ngl 0`: a prompt run computes logits for one row only, which is
    under the offload threshold."""
    from pyllama_moe.synth.gguf_read import read_gguf

    info = read_gguf(model, check_data=False)
    n_layer = int(info.arch_key("block_count", 0))
    first_gpu_layer = 0 if n_gpu_layers < 0 else max(0, n_layer + 1 - n_gpu_layers)
    total = 0
    for name, tensor in info.tensors.items():
        match = re.match(r"blk\.(\d+)\.", name)
        if len(tensor.shape) < 2 or match is None:  # vectors, the row lookup of embeddings, the output matrix
            continue
        layer = int(match.group(1))
        if layer < first_gpu_layer or (layer < n_cpu_moe and "_exps" in name):
            total += tensor.nbytes
    return total


def uploading_ubatches(n_prompt: int, n_batch: int, n_ubatch: int, min_tokens: int = OFFLOAD_MIN_BATCH) -> int:
    """Ubatches of a prompt run of at least min_tokens tokens: llama-bench (and llama.cpp) decode n_batch tokens at a
    time, each batch split into ubatches of n_ubatch. With the default, the ubatches that upload host weights at all
    (only those of at least OFFLOAD_MIN_BATCH tokens are offloaded); with the prefetch's min batch, those that
    upload them ahead."""
    count = 0
    for start in range(0, n_prompt, n_batch):
        batch = min(n_batch, n_prompt - start)
        full, rest = divmod(batch, n_ubatch)
        count += (full if n_ubatch >= min_tokens else 0) + (1 if rest >= min_tokens else 0)
    return count


def pcie_bound(fields: dict, host_bytes: int, gbps: float) -> float | None:
    """Tokens/s a prompt row cannot beat when every offloaded ubatch uploads `host_bytes` at `gbps`; None where
    no bound applies (decode rows compute host weights on the CPU; op offload off, small ubatches and all-on-GPU
    rows upload nothing)."""
    n_prompt, n_gen = fields.get("n_prompt") or 0, fields.get("n_gen") or 0
    if not n_prompt or n_gen or not host_bytes or gbps <= 0 or fields.get("no_op_offload"):
        return None
    n_batch = fields.get("n_batch") or n_prompt
    ubatches = uploading_ubatches(n_prompt, n_batch, min(fields.get("n_ubatch") or n_batch, n_batch))
    if not ubatches:
        return None
    return n_prompt / (ubatches * host_bytes / (gbps * 1e9))


def run_copy_probe(builds: dict[str, Build], mib: int = 512) -> dict | None:
    """The pinned host-to-device bandwidth of the first GPU, from whichever build has the probe; None (and a
    line saying why) when neither has it or no GPU is there."""
    for side in ("candidate", "baseline"):
        exe = builds[side].bin_dir / PROBE
        if exe.is_file():
            break
    else:
        say(f"pcie bound: neither build has {PROBE} (it is built with patched builds): no bound column")
        return None
    try:
        proc = subprocess.run([str(exe), "--mib", str(mib), "--reps", "10"], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        say(f"pcie bound: {PROBE} did not finish in {PROBE_TIMEOUT_S:.0f} s: no bound column")
        return None
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    found = [d for d in lines if d.get("pinned_gbps")]
    if not found:  # a later device failing does not void the lines of the first
        say(f"pcie bound: {PROBE} measured no pinned bandwidth (exit {proc.returncode}): "
            + (proc.stderr.strip().splitlines() or ["no output"])[-1])
        return None
    return found[0]


def probed_gbps(probes: list[dict]) -> float:
    """The pinned host-to-device bandwidth of a run: the mean of its copy probes (before and after the rounds)."""
    return statistics.fmean(p["pinned_gbps"] for p in probes)


def pcie_columns(result: BenchResult, model: Path, probes: list[dict]) -> dict[str, dict]:
    """Per row label: the bound in t/s and each build's share of it (median over its kept samples)."""
    gbps = probed_gbps(probes)
    out = {}
    for row in result.rows.values():
        ngl = row.fields.get("n_gpu_layers")
        host_bytes = host_upload_bytes(Path(model), row.fields.get("n_cpu_moe") or 0,
                                       -1 if ngl is None else ngl)  # llama-bench's default -ngl: -1
        bound = pcie_bound(row.fields, host_bytes, gbps)
        if bound is None:
            continue
        medians = {side: row.median(side) for side in SIDES}
        out[row.label] = {"pcie_bound_ts": bound, "pcie_host_bytes": host_bytes, "pcie_gbps": gbps,
                          **{f"pcie_share_{side}": (m / bound if m else None) for side, m in medians.items()}}
    return out


def cache_bound(result: BenchResult, limits: dict[str, dict], hits: dict[str, dict], probes: list[dict]) -> dict[str, dict]:
    """Per decode row of the candidate with an expert cache and a limit row (all on the GPU): what the row cannot beat,
    the limit's time per token plus the row's misses' bytes at the probed link rate, in tokens/s, and the candidate's
    share of it, as an interval (its share of the limit, scaled by the same factor: the bytes and the rate are taken
    as measured). A share of 1 is a cache whose own work costs nothing; 1 / 1.03 is 3% over the bound."""
    if not probes:
        return {}
    gbps = probed_gbps(probes)
    by_label = {row.label: row for row in result.rows.values()}
    out = {}
    for label, data in limits.items():
        lim, row = data["limit"], by_label.get(label)
        side_hits = hits.get(label, {}).get("hit_rate", {}).get("candidate") or {}
        per_token = side_hits.get("upload_bytes_per_token")
        limit_row = by_label.get(lim.get("row"))
        if row is None or limit_row is None or per_token is None or lim.get("share_candidate") is None:
            continue
        if not row.fields.get("n_gen") or row.fields.get("n_prompt"):
            continue  # prompt rows have the PCIe bound
        limit_ts = limit_row.median("baseline" if lim.get("limit_from") == "baseline" else "candidate")
        if not limit_ts:
            continue
        factor = 1 + per_token * limit_ts / (gbps * 1e9)
        scaled = {key: lim[key] * factor if lim.get(key) is not None else None
                  for key in ("share_candidate", "share_low", "share_high")}
        out[label] = {"cache_bound_ts": limit_ts / factor, "cache_bound_bytes_per_token": per_token, "cache_bound_gbps": gbps,
                      "cache_bound_share": scaled["share_candidate"], "cache_bound_share_low": scaled["share_low"],
                      "cache_bound_share_high": scaled["share_high"]}
    return out


def limit_columns(limits: dict[str, dict], pcie: dict[str, dict], names: dict[str, str],
                  bound: dict[str, dict] | None = None) -> dict[str, dict[str, str]]:
    """Table cells for the limit and PCIe columns (label -> column -> text)."""
    cells: dict[str, dict[str, str]] = {}
    for label, data in limits.items():
        lim = data["limit"]
        if lim.get("share_candidate") is None:
            continue
        span = (f" [{lim['share_low']:.3f}, {lim['share_high']:.3f}]" if lim.get("share_low") is not None else "")
        base = f"; {names['baseline']} {lim['share_baseline']:.3f}" if lim.get("share_baseline") else ""
        column = "share of the baseline's limit" if lim.get("limit_from") == "baseline" else "share of limit"
        cells.setdefault(label, {})[column] = f"{lim['share_candidate']:.3f}{span}{base}"
    for label, data in pcie.items():
        share = data.get("pcie_share_candidate")
        cells.setdefault(label, {})["PCIe bound t/s"] = f"{data['pcie_bound_ts']:.0f}"
        cells[label]["share of PCIe bound"] = f"{share:.3f}" if share is not None else ""
    for label, data in (bound or {}).items():
        span = (f" [{data['cache_bound_share_low']:.3f}, {data['cache_bound_share_high']:.3f}]"
                if data.get("cache_bound_share_low") is not None else "")
        cells.setdefault(label, {})["cache bound t/s"] = f"{data['cache_bound_ts']:.0f}"
        cells[label]["share of cache bound"] = f"{data['cache_bound_share']:.3f}{span}"
    return cells
