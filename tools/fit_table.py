"""The table of results/fit.md from the llama-bench JSON of `ci/gpu/fit.sh bench` (one file per row and round):
`python3 tools/fit_table.py DIR` (DIR: the step's $OUT)."""
import json, pathlib, re, statistics, sys
from pyllama_moe.bench.stats import paired_ratio_interval
d = pathlib.Path(sys.argv[1])
means = {}  # (row, test) -> {round: mean t/s of the invocation}
for f in sorted(d.glob("bench-*-r*.json")):
    row, rnd = re.match(r"bench-(.+)-r(\d+)$", f.stem).groups()
    rows, _ = json.JSONDecoder().raw_decode(f.read_text())
    for r in rows:
        test = "pp%d" % r["n_prompt"] if r["n_prompt"] else "tg%d" % r["n_gen"]
        means.setdefault((row, test), {})[int(rnd)] = statistics.fmean(r["samples_ts"])
least = {}
for line in (d / "least-free.txt").read_text().splitlines():
    m = re.match(r"least free MiB during (.+)-r(\d+): (\d+)", line)
    if m:
        least.setdefault(m.group(1), []).append(int(m.group(3)))
print("| row | least free MiB | test | t/s per round | fit+cache / row, 95% interval |")
print("|---|---|---|---|---|")
for (row, test), per in sorted(means.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    ref = means[("fit-cache", test)]
    pairs = [(per[k], ref[k]) for k in sorted(per) if k in ref]
    iv = paired_ratio_interval(pairs) if row != "fit-cache" else None
    ratio = "" if iv is None else (f"{iv.ratio:.3f} [{iv.low:.3f}, {iv.high:.3f}] (n={iv.n})" if iv.low else f"{iv.ratio:.3f}")
    print(f"| {row} | {min(least.get(row, [0]))} | {test} | {', '.join(f'{per[k]:.1f}' for k in sorted(per))} | {ratio} |")
