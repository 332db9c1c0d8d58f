"""The divergence contract (docs/identity.md, "Divergence"): its statistics on known inputs, the matrix's divergence
cells, the planted fault in the worker, and the SIM cells end to end through `pyllama-moe compare`."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pyllama_moe.errors import UserError
from pyllama_moe.harness import divergence, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR, PROJECT_ROOT
from pyllama_moe.worker.fault import parse_fault

SIM_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1"}


def test_kl_of_a_known_pair_of_distributions():
    # p = (1/2, 1/2) against q = (1/4, 3/4): KL(p || q) = 1/2 ln(2) + 1/2 ln(2/3) = 1/2 ln(4/3)
    ref = np.array([[0.0, 0.0], [1.0, 2.0]], dtype=np.float32)
    side = np.array([[0.0, math.log(3.0)], [1.0, 2.0]], dtype=np.float32)
    kl = divergence.position_kl(ref, side)
    assert kl[0] == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6) and kl[1] == 0.0
    assert list(divergence.top1_match(ref, side)) == [False, True]  # the reference's tie goes to token 0
    with pytest.raises(ValueError, match="shape"):
        divergence.position_kl(ref, side[:1])


def test_kl_rows_are_computed_in_pieces_without_changing_them():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((divergence.ROWS_AT_ONCE * 2 + 3, 40)).astype(np.float32)
    side = ref + rng.standard_normal(ref.shape).astype(np.float32) * 0.1
    rows = [0, divergence.ROWS_AT_ONCE, len(ref) - 1]  # the first piece's, the second's, the last one's
    alone = [divergence.position_kl(ref[i: i + 1], side[i: i + 1])[0] for i in rows]
    assert divergence.position_kl(ref, side)[rows] == pytest.approx(alone)


def test_statistics_of_known_values():
    kl = np.arange(100, dtype=float)
    stats = divergence.statistics(kl, np.arange(100) % 4 != 0)
    assert stats == {"mean": 49.5, "p99": pytest.approx(98.01), "max": 99.0, "top1": 0.75}


def test_blocks_stay_inside_their_segments():
    parts = divergence.blocks([70, 5, 32], block=32)
    assert [(int(b[0]), len(b)) for b in parts] == [(0, 32), (32, 32), (64, 6), (70, 5), (75, 32)]


def test_the_interval_of_a_mean_covers_it_with_the_width_theory_gives():
    # 3200 independent exponential values of mean 1: the 95% interval of the mean is about 1 +- 1.96 / sqrt(3200)
    kl = np.random.default_rng(2).exponential(1.0, 3200)
    match = np.ones(3200, dtype=bool)
    ci = divergence.bootstrap({"candidate": (kl, match)}, divergence.blocks([3200], 1), resamples=400)["candidate"]
    assert ci["mean"][0] < kl.mean() < ci["mean"][1] and ci["mean"][0] < 1.0 < ci["mean"][1]
    assert ci["mean"][1] - ci["mean"][0] == pytest.approx(2 * 1.96 / math.sqrt(3200), rel=0.25)
    assert ci["top1"] == [1.0, 1.0]


def test_blocks_widen_the_interval_of_correlated_positions():
    # each value repeated over 32 positions: single positions resampled pretend to 32 times the information
    kl = np.repeat(np.random.default_rng(3).exponential(1.0, 100), 32)
    match = np.ones(kl.size, dtype=bool)
    width = {}
    for block in (1, 32):
        ci = divergence.bootstrap({"candidate": (kl, match)}, divergence.blocks([kl.size], block), resamples=300)
        width[block] = ci["candidate"]["mean"][1] - ci["candidate"]["mean"][0]
    assert width[32] > 4 * width[1]


def _segments(rng, n=200, vocab=32, noise=0.0, flip_every=0):
    """Reference logits in two segments, and a side with `noise` added to each logit and, at every flip_every-th
    position, the reference's top token pushed below the rest."""
    ref = rng.standard_normal((n, vocab)).astype(np.float32)
    side = ref + (rng.standard_normal(ref.shape) * noise).astype(np.float32)
    flipped = np.arange(0, n, flip_every) if flip_every else np.arange(0)
    side[flipped, ref[flipped].argmax(axis=1)] -= 100
    return [ref[: n // 2], ref[n // 2:]], [side[: n // 2], side[n // 2:]]


def test_zero_against_zero_holds():
    ref, _ = _segments(np.random.default_rng(4))
    detail = divergence.contract(ref, ref, ref)
    assert detail["holds"] and detail["flagged"] == []
    for side in ("candidate", "yardstick"):
        assert detail[side]["mean"] == detail[side]["p99"] == detail[side]["max"] == 0.0 and detail[side]["top1"] == 1.0
        assert detail[side]["mean_ci"] == [0.0, 0.0] and detail[side]["top1_ci"] == [1.0, 1.0]
    assert detail["difference"] == {"mean": [0.0, 0.0], "p99": [0.0, 0.0], "top1": [0.0, 0.0]}
    assert detail["segments"] == [100, 100]


def test_a_candidate_worse_than_the_yardstick_is_flagged_and_an_equal_or_better_one_is_not():
    rng = np.random.default_rng(5)
    ref, small = _segments(rng, noise=0.01)
    _, large = _segments(np.random.default_rng(5), noise=0.2)  # the same reference, drawn again
    assert not divergence.contract(ref, small, large)["flagged"]  # better than the yardstick
    assert not divergence.contract(ref, large, large)["flagged"]  # equal: the difference is exactly 0
    worse = divergence.contract(ref, large, small)
    assert {"mean", "p99"} <= set(worse["flagged"]) and not worse["holds"]
    assert worse["difference"]["mean"][0] > 0 and worse["candidate"]["mean"] > worse["yardstick"]["mean"]


def test_top1_agreement_lower_than_the_yardsticks_is_flagged():
    ref, flipped = _segments(np.random.default_rng(6), flip_every=10)
    detail = divergence.contract(ref, flipped, ref)
    assert "top1" in detail["flagged"] and detail["candidate"]["top1"] == pytest.approx(0.9)
    assert detail["difference"]["top1"][1] < 0


def test_the_matrix_has_the_divergence_cells_and_checks_their_options(tmp_path):
    m = load_matrix(CI_DIR / "matrix.toml")
    cells = {c.label: c for c in m.cells("divergence")}
    assert set(cells) == {"divergence/sim-ncmoe-2", "control/sim-divergence-fault", "divergence/cuda-ncmoe-2",
                          "divergence/sim-hot-cold-cpu", "divergence/cuda-hot-cold-cpu"}
    assert {c.label for c in m.cells("ci") if c.expect.startswith("divergence")} == \
        {"divergence/sim-ncmoe-2", "control/sim-divergence-fault", "divergence/sim-hot-cold-cpu"}
    fault = cells["control/sim-divergence-fault"]
    assert fault.expect == "divergence-flagged" and parse_fault(fault.fault) == {"layer": 2, "expert": 3, "eps": 0.05}
    assert fault.yardstick_placement() == {"cpu_moe": True} and fault.placement(baseline=True) == {}
    bad = {'yardstick = "cpu-moe"': "belong to a divergence cell",
           'expect = "divergence"\nyardstick = "gpu-moe"': "is no placement",
           'expect = "divergence"\nyardstick = "ot:1,3"\nfault = "layer:1"': "needs all of",
           'expect = "divergence"\nyardstick = "cpu-moe"\nfault = "layer:1,expert:2,eps:0.1"\neval_callback = 4':
               "eval_callback must be 0",
           'expect = "divergence"\nyardstick = "cpu-moe"\nparallel = 2': "one sequence"}
    for options, why in bad.items():
        path = tmp_path / "m.toml"
        path.write_text(f'[models.m]\narch = "qwen3moe"\n[axes]\nmodel = ["m"]\n[defaults]\n{options}\n')
        with pytest.raises(UserError, match=why):
            load_matrix(path).cells("full")
    path.write_text('[models.m]\narch = "qwen3moe"\n[axes]\nmodel = ["m"]\n[defaults]\nexpect = "divergence"\n'
                    'yardstick = "ot:1,3"\n')
    assert load_matrix(path).cells("full")[0].yardstick_placement() == {"cpu_moe_layers": [1, 3]}


def test_a_fault_is_parsed_or_refused():
    assert parse_fault("layer:0, expert:15, eps:-0.5") == {"layer": 0, "expert": 15, "eps": -0.5}
    for text in ("layer:1,expert:3", "layer:1,expert:3,eps:x", "layer:-1,expert:3,eps:0.1", "depth:1,expert:3,eps:0.1"):
        with pytest.raises(ValueError):
            parse_fault(text)


def _run(build, src, model, **kw):
    return runner.run(build, src, runner.RunSpec(model=model, prompt="The quick brown fox " * 40, max_prompt_tokens=96,
                                                 generate=6, threads=2, repack=False, n_cpu_moe=2, env=SIM_ENV,
                                                 want_decode_logits=True, ppl_chunks=(64, 2), **kw))


def test_the_worker_plants_the_fault_forces_tokens_and_scores_chunks(patched_build, src, tiny_model):
    plain = _run(patched_build, src, tiny_model)
    assert plain.decode_logits.shape == (5, plain.logits.shape[1]) and plain.ppl_logits.shape[0] == 2 * 31
    # a fault of 0 writes back the bytes it read: the callback alone changes nothing
    zero = _run(patched_build, src, tiny_model, fault={"layer": 2, "expert": 3, "eps": 0.0})
    assert zero.fault_rows_scaled > 0 and zero.logits_sha256 == plain.logits_sha256
    assert zero.decode_logits_sha256 == plain.decode_logits_sha256 and np.array_equal(zero.ppl_logits, plain.ppl_logits)
    # a fault in layer 2 leaves nothing before it: the prompt's logits change, and so do the chunks'
    scaled = _run(patched_build, src, tiny_model, fault={"layer": 2, "expert": 3, "eps": 0.05})
    assert scaled.fault_rows_scaled == zero.fault_rows_scaled and scaled.logits_sha256 != plain.logits_sha256
    assert not np.array_equal(scaled.ppl_logits, plain.ppl_logits)
    # teacher forcing: the tokens given are the tokens decoded, whatever the argmax
    forced = list(reversed(plain.generated))
    assert _run(patched_build, src, tiny_model, forced_tokens=forced).generated == forced


def test_the_sim_cells_hold_and_the_planted_fault_is_flagged(master_build, patched_build, tmp_path):
    out = tmp_path / "divergence.json"
    proc = subprocess.run([sys.executable, "-m", "pyllama_moe", "compare", "--baseline", "master", "--candidate",
                           "patched", "--subset", "divergence", "--no-build", "--json", str(out)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=1800)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    cells = {c["label"]: c for c in json.loads(out.read_text())["cells"]}
    # the CUDA cells wait for a GPU; every other one ran on SIM
    if not shutil.which("nvidia-smi"):
        for label in ("divergence/cuda-ncmoe-2", "divergence/cuda-hot-cold-cpu"):
            assert cells.pop(label)["status"] == "deferred"
    assert set(cells) == {"divergence/sim-ncmoe-2", "control/sim-divergence-fault", "divergence/sim-hot-cold-cpu"}
    for label, cell in cells.items():
        assert cell["status"] == "pass", cell
        checks = {c["name"]: c for c in cell["checks"]}
        assert set(checks) == {"sim-races", "divergence"} and checks["sim-races"]["identical"]
        detail = checks["divergence"]["detail"]
        # 600 prompt positions, 63 decode steps, 2 chunks of 1024 of which llama-perplexity scores 511 each
        assert detail["positions"] == {"prompt": 600, "decode": 63, "perplexity": 1022}
        assert detail["yardstick"]["max"] == 0.0 and detail["yardstick"]["top1"] == 1.0  # SIM: the CPU's kernels
    for label in ("divergence/sim-ncmoe-2", "divergence/sim-hot-cold-cpu"):
        clean = {c["name"]: c for c in cells[label]["checks"]}["divergence"]
        assert clean["identical"] and clean["detail"]["candidate"]["max"] == 0.0
        assert clean["detail"]["difference"] == {"mean": [0.0, 0.0], "p99": [0.0, 0.0], "top1": [0.0, 0.0]}
    fault = {c["name"]: c for c in cells["control/sim-divergence-fault"]["checks"]}["divergence"]
    assert not fault["identical"] and {"mean", "p99"} <= set(fault["detail"]["flagged"])
    assert fault["detail"]["fault"]["rows_scaled"] > 0 and fault["detail"]["difference"]["mean"][0] > 0
    assert "divergence=FLAGGED" in proc.stdout and "(expect flagged)" in proc.stdout
