"""The divergence contract: a path that mixes CPU and GPU kernels computes bytes no single build computes, so it is
held to a yardstick instead of byte identity (docs/identity.md, "Divergence").

Against a reference (master, every weight on the device), per position over the same tokens (teacher-forced): the
candidate's KL divergence KL(reference || candidate) and top-1 agreement, side by side with the yardstick's (master
--cpu-moe, or the -ot rule the cell names). The candidate passes when neither its mean KL nor its 99th percentile is
shown larger than the yardstick's, and its top-1 agreement is not shown lower: "shown" by a paired block bootstrap of
the difference, whose whole interval must lie on the wrong side of zero to flag it. Equal sides (both exactly zero on
SIM) give an interval of [0, 0]: equal passes.
"""

from __future__ import annotations

import numpy as np
from scipy.special import log_softmax

# Blocks of contiguous positions, resampled whole: a change in one position's computation reaches the later positions
# through the KV memory (and a decode step feeds the next), so neighbouring KLs are correlated and a bootstrap of single
# positions would give too narrow an interval. 32 keeps that correlation inside a block and leaves about 90 blocks over
# a cell's ~2800 positions; the 2 perplexity chunks alone would be too few to resample.
BLOCK = 32
RESAMPLES = 1000
LEVEL = 0.95
ROWS_AT_ONCE = 512  # positions per log_softmax pass: a vocabulary of 150k in float64 stays near 600 MiB
STATS = ("mean", "p99", "top1")


def position_kl(reference: np.ndarray, side: np.ndarray) -> np.ndarray:
    """KL(reference || side) of every position (row) of two logit arrays, in nats, from the log-probabilities in
    float64 (a side's probability that underflows to 0 leaves it finite)."""
    if reference.shape != side.shape:
        raise ValueError(f"logits of shape {side.shape} against a reference of {reference.shape}")
    out = np.empty(reference.shape[0])
    for lo in range(0, reference.shape[0], ROWS_AT_ONCE):
        lr = log_softmax(reference[lo: lo + ROWS_AT_ONCE].astype(np.float64), axis=1)
        ls = log_softmax(side[lo: lo + ROWS_AT_ONCE].astype(np.float64), axis=1)
        out[lo: lo + ROWS_AT_ONCE] = np.maximum((np.exp(lr) * (lr - ls)).sum(axis=1), 0.0)  # rounding can dip below 0
    return out


def top1_match(reference: np.ndarray, side: np.ndarray) -> np.ndarray:
    """Per position: whether the side's argmax is the reference's."""
    return reference.argmax(axis=1) == side.argmax(axis=1)


def blocks(segment_lengths: list[int], block: int = BLOCK) -> list[np.ndarray]:
    """The position indices of each block: contiguous runs of `block` within each segment (prompt, decode, each
    perplexity chunk), the last of a segment shorter; a block never spans two segments, which are not contiguous."""
    out, start = [], 0
    for n in segment_lengths:
        out += [np.arange(start + lo, start + min(lo + block, n)) for lo in range(0, n, block)]
        start += n
    return out


def statistics(kl: np.ndarray, match: np.ndarray) -> dict:
    """Mean, 99th percentile and maximum KL, and top-1 agreement, of some positions."""
    return {"mean": float(kl.mean()), "p99": float(np.percentile(kl, 99)), "max": float(kl.max()),
            "top1": float(match.mean())}


def bootstrap(sides: dict[str, tuple[np.ndarray, np.ndarray]], parts: list[np.ndarray], resamples: int = RESAMPLES,
              level: float = LEVEL, seed: int = 0) -> dict[str, dict[str, list[float]]]:
    """Percentile intervals of mean, p99 and top1 for every side ({name: (kl, match)}) and of the candidate's minus the
    yardstick's, from the same resampled blocks for every side (the positions are paired: the same tokens). A fixed
    seed, so that a report is reproducible."""
    rng = np.random.default_rng(seed)
    draws = {name: {s: np.empty(resamples) for s in STATS} for name in sides}
    for r in range(resamples):
        idx = np.concatenate([parts[i] for i in rng.integers(0, len(parts), len(parts))])
        for name, (kl, match) in sides.items():
            picked = kl[idx]
            draws[name]["mean"][r], draws[name]["p99"][r] = picked.mean(), np.percentile(picked, 99)
            draws[name]["top1"][r] = match[idx].mean()
    tail = 100 * (1 - level) / 2

    def interval(values: np.ndarray) -> list[float]:
        return [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))]

    out = {name: {s: interval(d[s]) for s in STATS} for name, d in draws.items()}
    if {"candidate", "yardstick"} <= set(sides):
        out["difference"] = {s: interval(draws["candidate"][s] - draws["yardstick"][s]) for s in STATS}
    return out


def flagged(difference: dict[str, list[float]]) -> list[str]:
    """The statistics on which the candidate is shown worse than the yardstick: the whole interval of (candidate -
    yardstick) above zero for mean and p99 KL, below zero for top-1 agreement."""
    worse = [s for s in ("mean", "p99") if difference[s][0] > 0]
    return worse + (["top1"] if difference["top1"][1] < 0 else [])


def contract(reference: list[np.ndarray], candidate: list[np.ndarray], yardstick: list[np.ndarray],
             block: int = BLOCK) -> dict:
    """The contract over logit segments (prompt, decode steps, perplexity chunks; the same tokens on every side):
    per side its statistics and their intervals, the intervals of the difference, and what was flagged ("holds": none
    was)."""
    ref = np.concatenate(reference)
    sides = {name: (position_kl(ref, np.concatenate(logits)), top1_match(ref, np.concatenate(logits)))
             for name, logits in (("candidate", candidate), ("yardstick", yardstick))}
    lengths = [len(seg) for seg in reference]
    intervals = bootstrap(sides, blocks(lengths, block))
    detail = {"segments": lengths, "block": block, "resamples": RESAMPLES, "level": LEVEL}
    for name, (kl, match) in sides.items():
        detail[name] = {**statistics(kl, match), **{f"{s}_ci": intervals[name][s] for s in STATS}}
    detail["difference"] = intervals["difference"]
    detail["flagged"] = flagged(intervals["difference"])
    detail["holds"] = not detail["flagged"]
    return detail


def summary_line(detail: dict) -> str:
    """One table cell of a contract's numbers: per side mean, p99 and max KL and top-1 agreement, the intervals of
    mean, p99 and top-1, and what was flagged."""
    def side(name: str) -> str:
        d = detail[name]
        return (f"{name} kl mean {d['mean']:.3g} {_ci(d['mean_ci'])} p99 {d['p99']:.3g} {_ci(d['p99_ci'])} "
                f"max {d['max']:.3g} top1 {d['top1']:.4f} {_ci(d['top1_ci'], '.4f')}")

    flags = ",".join(detail["flagged"]) or "none"
    return f"{side('candidate')} | {side('yardstick')} | flagged: {flags}"


def _ci(interval: list[float], fmt: str = ".3g") -> str:
    return f"[{interval[0]:{fmt}}, {interval[1]:{fmt}}]"
