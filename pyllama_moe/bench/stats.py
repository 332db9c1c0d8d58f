"""Statistics of A/B benchmarks: a ratio with a confidence interval from paired, interleaved blocks.

The unit is one llama-bench process, not a repetition: repetitions of one process agree far better than two
processes do, so counting them as independent gives intervals far too narrow. The method is the paired t-interval
on log ratios, exp(mean d -/+ t * sd(d) / sqrt(n)) with d_i = ln(candidate_i / baseline_i). Why pairs, logs and
the t quantile: docs/benchmarks.md, "The ratio and its 95% interval".
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from scipy.stats import t as student_t

CONFIDENCE = 0.95
METHOD = "paired t-interval on log ratios of per-invocation means (one invocation per build per round)"


@dataclass(frozen=True)
class RatioInterval:
    ratio: float  # exp(mean log ratio): the geometric mean of the per-round ratios
    low: float | None  # None with fewer than two rounds: no spread to estimate
    high: float | None
    n: int
    confidence: float = CONFIDENCE

    @property
    def half_width(self) -> float | None:
        """Relative half-width: exp(t * sd / sqrt(n)) - 1, the distance of either end from the estimate."""
        if self.low is None or self.high is None:
            return None
        return math.sqrt(self.high / self.low) - 1.0

    def excludes(self, value: float = 1.0) -> bool:
        return self.low is not None and self.high is not None and not (self.low <= value <= self.high)


def paired_ratio_interval(pairs: list[tuple[float, float]], confidence: float = CONFIDENCE) -> RatioInterval | None:
    """Interval of candidate/baseline from (baseline, candidate) pairs of positive rates; None without pairs."""
    for base, cand in pairs:
        if not (base > 0 and cand > 0):
            raise ValueError(f"rates must be positive, got the pair ({base}, {cand})")
    logs = [math.log(cand / base) for base, cand in pairs]
    if not logs:
        return None
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return RatioInterval(math.exp(mean), None, None, len(logs), confidence)
    half = student_t.ppf((1.0 + confidence) / 2.0, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return RatioInterval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(logs), confidence)


def cv(values: list[float]) -> float | None:
    """Coefficient of variation (sample standard deviation over mean); None for fewer than two values."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    return statistics.stdev(values) / mean if mean else None


def within_cv(blocks: list[list[float]]) -> float | None:
    """Pooled CV of the repetitions inside each invocation: the noise a longer run of one process averages away."""
    usable = [b for b in blocks if len(b) >= 2]
    if not usable:
        return None
    variance = sum(statistics.variance(b) * (len(b) - 1) for b in usable) / sum(len(b) - 1 for b in usable)
    mean = statistics.fmean(x for b in usable for x in b)
    return math.sqrt(variance) / mean if mean else None
