"""The llama-bench thread arguments the noise study (`bench-stats.sh study`) supports best.

    python3 ci/gpu/pick_threads.py study.json   ->  e.g. "-t 8 -C 0xffff --cpu-strict 1"

The study ran master against itself, so both sides' processes are samples of one build. Among the thread
settings whose decode rate is within 3% of the fastest, the one whose processes agree best (smallest CV
between per-process means) wins: the intervals' width is made of that CV, while a setting 3% slower would
make every host-expert row slower than users run it.
"""

from __future__ import annotations

import json
import statistics
import sys


def main(path: str) -> None:
    tests = json.load(open(path))["tests"]
    scored = []
    for t in tests:
        blocks: dict[tuple, list[float]] = {}
        for s in t["samples"]:
            if not s["discarded"]:
                blocks.setdefault((s["side"], s["round"]), []).append(s["ts"])
        means = [statistics.fmean(v) for v in blocks.values()]
        rate = statistics.median(s["ts"] for s in t["samples"] if not s["discarded"])
        between = statistics.stdev(means) / statistics.fmean(means) if len(means) > 1 else float("inf")
        scored.append((t["key"], rate, between, t["test"]))
    best_rate = max(rate for _, rate, _, _ in scored)
    key, rate, between, label = min((x for x in scored if x[1] >= 0.97 * best_rate), key=lambda x: x[2])
    for _, r, b, lab in scored:
        print(f"{lab}: {r:.2f} t/s, CV between processes {b:.2%}", file=sys.stderr)
    print(f"chosen: {label}", file=sys.stderr)
    args = ["-t", str(key["n_threads"])]
    if key.get("cpu_strict"):
        args += ["-C", str(key["cpu_mask"]), "--cpu-strict", "1"]
    print(" ".join(args))


if __name__ == "__main__":
    main(sys.argv[1])
