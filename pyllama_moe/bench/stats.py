"""Statistics of A/B benchmarks: a ratio with a confidence interval from paired, interleaved blocks.

The unit of a benchmark sample is one llama-bench process (an "invocation"), not one repetition inside it:
on the GPU machine, repetitions of one process agree to a fraction of a percent while two processes of the
same build differ by 2-4% (where the process's memory and threads land), so repetitions are not independent
and treating them as such gives intervals that are far too narrow. Each round runs one invocation of each
build, back to back; the block mean of an invocation is the mean of its kept repetitions (the first ones are
warm-up and are dropped).

Method: the paired t-interval on log ratios. Per round i, d_i = ln(candidate_i / baseline_i); the estimate is
exp(mean d) and the interval exp(mean d -/+ t_{(1+c)/2, n-1} * sd(d) / sqrt(n)). Pairing adjacent invocations
cancels slow drift of the machine that both builds see; logs make the interval symmetric in ratio terms
(a 3% loss and a 3% gain are equally far from 1.0). The t quantile, not a bootstrap, because the useful
number of rounds is small (5-15), where a bootstrap's intervals are too narrow.
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
