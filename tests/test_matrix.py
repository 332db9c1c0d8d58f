import itertools

import numpy as np
import pytest

from pyllama_moe.compare import logit_diagnostics, summarize, CellResult
from pyllama_moe.errors import UserError
from pyllama_moe.matrix import AXES, load_matrix, pairwise_cover
from pyllama_moe.paths import CI_DIR


def test_ci_subset_covers_every_pair_of_cpu_column_values():
    m = load_matrix(CI_DIR / "matrix.toml")
    ci = [c for c in m.cells("ci") if not c.name]
    axes = [a for a in AXES if a in m.axes]
    wanted = set()
    for combo in m._product({"backend": ["cpu"]}):
        wanted |= {(a, combo[a], b, combo[b]) for a, b in itertools.combinations(axes, 2)}
    got = set()
    for c in ci:
        got |= {(a, getattr(c, a), b, getattr(c, b)) for a, b in itertools.combinations(axes, 2)}
    assert wanted <= got
    # a cover, not the product: every pair of values at least once in a small fraction of the cells it covers
    # (with 7 knob values and 3 backends it is no longer smaller than the 24 CPU cells of the product)
    product = m._product({"backend": ["cpu", "sim", "sim2"]})
    assert len(ci) * 20 < len(product)


def test_cpu_subset_has_both_models_both_load_modes_both_ubatches():
    cells = [c for c in load_matrix(CI_DIR / "matrix.toml").cells("cpu") if c.expect == "identical"]
    assert {(c.model, c.load, c.ubatch) for c in cells} >= {
        (m, lm, ub) for m in ("qwen3moe", "glm4moe") for lm in ("mmap", "none") for ub in (512, 2048)}


def test_pairwise_cover_is_exact_on_a_small_product():
    combos = [dict(zip("abc", v)) for v in itertools.product([0, 1], [0, 1], [0, 1, 2])]
    chosen = pairwise_cover(combos, list("abc"))
    for x, y in (("a", "b"), ("a", "c"), ("b", "c")):
        assert {(c[x], c[y]) for c in chosen} == {(c[x], c[y]) for c in combos}


def _matrix_file(tmp_path, text):
    path = tmp_path / "m.toml"
    path.write_text('[models.m]\narch = "qwen3moe"\n[axes]\nmodel = ["m"]\n' + text)
    return path


def test_unknown_cell_option_is_named(tmp_path):
    m = load_matrix(_matrix_file(tmp_path, '[defaults]\nwarp_speed = 9\n'))
    with pytest.raises(UserError, match="unknown option 'warp_speed'"):
        m.cells()


def test_unknown_value_and_axis_are_named(tmp_path):
    m = load_matrix(_matrix_file(tmp_path, '[defaults]\noffload = "gpu-moe"\n'))
    with pytest.raises(UserError, match="unknown offload 'gpu-moe'"):
        m.cells()
    with pytest.raises(UserError, match="unknown axis 'colour'"):
        load_matrix(_matrix_file(tmp_path, 'colour = ["red"]\n'))
    with pytest.raises(UserError, match="does not exist"):
        load_matrix(tmp_path / "missing.toml")


def test_logit_diagnostics_locate_the_first_difference():
    rng = np.random.default_rng(0)
    base = rng.standard_normal((6, 50)).astype(np.float32)
    same = logit_diagnostics(base, base.copy())
    assert same["first_diff_pos"] is None and same["max_abs"] == 0.0 and same["top1_agreement"] == 1.0
    cand = base.copy()
    cand[3, 7] += 0.5
    cand[5] = -cand[5]
    d = logit_diagnostics(base, cand)
    assert d["first_diff_pos"] == 3 and d["positions_differing"] == 2
    assert d["max_abs"] == pytest.approx(float(np.max(np.abs(2 * base[5]))), rel=1e-6)
    assert d["mean_kld"] > 0 and d["top1_agreement"] < 1.0


def test_a_run_with_no_passed_cell_fails():
    assert summarize([])[0] == 1
    assert summarize([CellResult(None, "deferred")])[0] == 1
    assert summarize([CellResult(None, "pass"), CellResult(None, "deferred")])[0] == 0
    assert summarize([CellResult(None, "pass"), CellResult(None, "fail")])[0] == 1


def test_split_model_cells_are_in_the_ci_and_gpu_subsets():
    m = load_matrix(CI_DIR / "matrix.toml")
    assert m.models["qwen3moe-split"]["split"] == 3
    for subset, backends in (("ci", {"cpu", "sim", "sim2"}), ("gpu", {"cuda"})):
        cells = [c for c in m.cells(subset) if c.model == "qwen3moe-split"]
        assert {c.backend for c in cells} == backends and all(c.load == "mmap" for c in cells)
    # extra cells stay out of subsets whose filter they do not match
    assert not [c for c in m.cells("prefetch") + m.cells("demo") if c.model == "qwen3moe-split"]


def test_gpt_oss_cells_are_in_ci_on_cpu_and_sim_with_experts_on_the_host():
    m = load_matrix(CI_DIR / "matrix.toml")
    assert m.models["gpt-oss"]["arch"] == "gpt-oss" and m.models["gpt-oss"]["type"] == "q8_0"
    cells = [c for c in m.cells("ci") if c.model == "gpt-oss"]
    # CI time: a few cells (4, and the expert cache's two, small and whole, whose banks carry gpt-oss's biases)
    assert {c.backend for c in cells} == {"cpu", "sim", "sim2"} and len(cells) <= 6
    assert all(c.offload != "all" and c.expect == "identical" for c in cells)
    # the gpt-oss subset is these and its CUDA cells (the expert cache's, on the GPU machine)
    assert {c.label for c in m.cells("gpt-oss") if c.backend != "cuda"} == {c.label for c in cells}
    assert not [c for c in m.cells("prefetch") + m.cells("demo") + m.cells("gpu") if c.model == "gpt-oss"]


def test_extra_cells_are_checked(tmp_path):
    m = load_matrix(_matrix_file(tmp_path, '[[cells]]\nmodel = "m"\nbackend = "tpu"\n'))
    with pytest.raises(UserError, match="unknown backend 'tpu'"):
        m.cells()


def test_a_cell_may_place_its_baseline_apart(tmp_path):
    m = load_matrix(CI_DIR / "matrix.toml")
    cuda = [c for c in m.cells("moe-cache") if c.backend == "cuda"]
    assert cuda and all(c.baseline_offload == "all" for c in cuda)
    cell = cuda[0]
    assert cell.placement(baseline=True) == {} and cell.placement() == {"cpu_moe": True}
    sim = next(c for c in m.cells("moe-cache") if c.backend == "sim")
    assert sim.placement(baseline=True) == sim.placement()  # no baseline placement: the same as the candidate's
    bad = load_matrix(_matrix_file(tmp_path, '[[cells]]\nmodel = "m"\nbaseline_offload = "most"\n'))
    with pytest.raises(UserError, match="unknown offload 'most'"):
        bad.cells()
