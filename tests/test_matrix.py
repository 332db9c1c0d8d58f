import itertools
import re

import numpy as np
import pytest

from pyllama_moe.errors import UserError
from pyllama_moe.harness.compare import logit_diagnostics, summarize, CellResult
from pyllama_moe.harness.matrix import AXES, load_matrix, pairwise_cover
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


def _steps(**counts):
    return {p: counts.get(p, 0) for p in ("in_place", "device", "host_plan", "staging", "host", "hot_cold")}


def test_a_by_path_reference_is_named_by_the_layers_that_left_the_banks():
    from pyllama_moe.harness.compare import choose_reference

    experts = {0, 1, 2, 3}
    reading = {il: _steps(device=15) for il in experts}
    ref = choose_reference(reading, experts, experts)
    assert (ref["reference"], ref["cpu_layers"], ref["placement"]) == ("all", [], {})
    # in place and the host-side plan read the banks too
    ref = choose_reference({0: _steps(in_place=15), 1: _steps(host_plan=15), 2: _steps(device=15),
                            3: _steps(device=15)}, experts, experts)
    assert ref["reference"] == "all"
    leaving = {0: _steps(staging=15), 1: _steps(staging=15), 2: _steps(host=15), 3: _steps(host=15)}
    ref = choose_reference(leaving, experts, experts)
    assert (ref["reference"], ref["cpu_layers"], ref["placement"]) == ("cpu-moe", [0, 1, 2, 3], {"cpu_moe": True})
    mixed = {0: _steps(device=15), 1: _steps(device=15), 2: _steps(staging=15), 3: _steps(staging=15)}
    ref = choose_reference(mixed, experts, experts)
    assert (ref["reference"], ref["placement"]) == ("-ot", {"cpu_moe_layers": [2, 3]})
    assert ref["ot"] == r"blk\.(2|3)\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"
    assert ref["paths"] == {"0": "device", "1": "device", "2": "staging", "3": "staging"}
    # a host layer without slots (no path counted) computes on the CPU like one that left the banks
    ref = choose_reference({0: _steps(device=15), 1: _steps(device=15)}, experts, experts)
    assert (ref["reference"], ref["cpu_layers"]) == ("-ot", [2, 3])
    # -ncmoe 2: the layers above keep their experts on the GPU, so leaving both host layers is not --cpu-moe
    ref = choose_reference({0: _steps(staging=15), 1: _steps(staging=15)}, {0, 1}, experts)
    assert (ref["reference"], ref["placement"]) == ("-ot", {"cpu_moe_layers": [0, 1]})
    ref = choose_reference({0: _steps(device=15), 1: _steps(device=15)}, {0, 1}, experts)
    assert ref["reference"] == "all"


def test_a_layer_that_read_the_banks_and_left_them_has_no_reference():
    from pyllama_moe.harness.compare import choose_reference

    experts = {0, 1, 2, 3}
    paths = {0: _steps(device=15), 1: _steps(device=9, staging=6), 2: _steps(staging=15), 3: _steps(staging=15)}
    with pytest.raises(UserError, match=r"cached layer 1 read the banks in some decode steps and left them in others "
                                        r"\(device 9, staging 6\)"):
        choose_reference(paths, experts, experts)
    with pytest.raises(UserError, match="no cached layer counted a decode step"):
        choose_reference({}, experts, experts)
    # two paths that both read the banks leave the reference defined (here the -ot rule for layers 2 and 3)
    paths[1] = _steps(device=9, in_place=6)
    assert choose_reference(paths, experts, experts)["reference"] == "-ot"


def test_hot_cold_layers_equal_the_cpu_on_sim_and_have_no_byte_reference_on_cuda():
    from pyllama_moe.harness.compare import choose_reference

    experts = {0, 1, 2, 3}
    hot_cold = {il: _steps(hot_cold=15) for il in experts}
    # SIM computes both branches with the CPU's kernels: master --cpu-moe's bytes, on every SIM backend
    for backend in ("cpu", "sim", "sim2"):
        assert choose_reference(hot_cold, experts, experts, backend)["reference"] == "cpu-moe"
    some = {0: _steps(device=15), 1: _steps(device=15), 2: _steps(hot_cold=15), 3: _steps(hot_cold=15)}
    assert choose_reference(some, experts, experts, "sim")["cpu_layers"] == [2, 3]
    with pytest.raises(UserError, match="cached layer 0 was computed hot/cold on cuda"):
        choose_reference(hot_cold, experts, experts, "cuda")
    # a layer hot/cold in some steps and on the banks alone in others has no one reference either
    with pytest.raises(UserError, match="cached layer 1 read the banks in some decode steps"):
        choose_reference({**some, 1: _steps(device=9, hot_cold=6)}, experts, experts, "sim")


CACHE_LINE = ("llama_moe: expert cache on {dev}: 2.99 MiB, {n} MoE layers with their experts on the host, {lo}-{hi} of "
              "16 expert slots each; graphs of up to 8 tokens read them (LLAMA_MOE_CACHE_DECODE_MAX)\n"
              "llama_moe: expert cache on {dev}: decode looks up its slots and fills its misses on the device\n")


def test_the_paths_check_holds_each_layer_to_the_path_its_slots_name():
    from pyllama_moe.harness.compare import paths_check, predicted_paths

    split = CACHE_LINE.format(dev="SIM0", n=4, lo=7, hi=8)
    assert predicted_paths(split, 2, 4) == {"device": (1, 3), "staging": (1, 3)}
    assert predicted_paths(split, 4, 4) == {"staging": (4, 4)}
    assert predicted_paths(split, 12, 4) == {"host": (4, 4)}
    assert predicted_paths(split, 1, 4) == {"device": (4, 4)}
    mixed = {0: _steps(device=15), 1: _steps(device=15), 2: _steps(staging=15), 3: _steps(staging=15)}
    assert paths_check(mixed, split, 2, 4, 15).identical
    # a path miscounted: every layer staging where the slots say some read the banks, or a graph of 4 on the device
    assert not paths_check({il: _steps(staging=15) for il in range(4)}, split, 2, 4, 15).identical
    assert not paths_check({il: _steps(device=15) for il in range(4)}, split, 4, 4, 15).identical
    # a step missing, a layer on two paths, or no cache line to predict from
    assert not paths_check({**mixed, 3: _steps(staging=14)}, split, 2, 4, 15).identical
    assert not paths_check({**mixed, 1: _steps(device=10, in_place=5)}, split, 2, 4, 15).identical
    assert not paths_check(mixed, "", 2, 4, 15).identical
    # two devices, their layers counted together; without the lookup line a device plans on the host
    two = CACHE_LINE.format(dev="SIM0", n=3, lo=5, hi=5)
    two += CACHE_LINE.format(dev="SIM1", n=1, lo=10, hi=10).splitlines()[0]
    assert predicted_paths(two, 2, 4) == {"staging": (3, 3), "host_plan": (1, 1)}
    # a device whose layers decode hot/cold: graphs that may not fit the slots (or any, under another policy)
    hot = ("llama_moe: expert cache on SIM0: miss policy {p}; decode graphs of up to 31 tokens compute the misses they "
           "do not upload, and the experts past the slots, on the CPU beside the banks (hot/cold)\n")
    assert predicted_paths(split + hot.format(p="upload"), 2, 4) == {"device": (1, 3), "hot_cold": (1, 3)}
    assert predicted_paths(split + hot.format(p="upload"), 12, 4) == {"hot_cold": (4, 4)}
    assert predicted_paths(split + hot.format(p="upload"), 40, 4) == {"host": (4, 4)}
    assert predicted_paths(split + hot.format(p="cpu"), 1, 4) == {"hot_cold": (4, 4)}


def test_the_parallel_cells_parse_with_a_by_path_baseline_on_sim_and_cuda(tmp_path):
    m = load_matrix(CI_DIR / "matrix.toml")
    cells = m.cells("moe-cache-parallel")
    for backend in ("sim", "cuda"):
        mine = [c for c in cells if c.backend == backend]
        assert {(c.knobs, c.parallel) for c in mine} == {
            *((k, n) for k in ("moe-cache", "moe-cache-half") for n in (2, 4, 8, 12)), ("moe-cache-10-slots", 2)}
        assert all(c.baseline_offload == "by-path" and c.label.endswith(f"/p{c.parallel}") for c in mine)
    assert {m.knobs[c.knobs]["LLAMA_MOE_CACHE_MIB"] for c in cells} == {"2", "3", "4"}
    # the SIM ones run in CI; the CUDA ones on the GPU machine, not in the one-at-a-time `moe-cache`
    # (with the CPU splits' worker, `async-cpu`'s parallel cells too)
    async_parallel = {c.label for c in m.cells("async-cpu") if c.parallel > 1 and c.backend == "sim"}
    assert async_parallel and {c.label for c in m.cells("ci") if c.parallel > 1} == \
        {c.label for c in cells if c.backend == "sim"} | async_parallel
    assert not [c for c in m.cells("moe-cache") if c.parallel > 1]
    # (ci/gpu/common.sh's identity_subset compares a subset's CUDA cells)
    assert re.search(r"^\s*identity_subset \d+ moe-cache-parallel ", (CI_DIR / "gpu" / "cache.sh").read_text(), re.M)
    assert "--subset \"$2\" --backend cuda" in (CI_DIR / "gpu" / "common.sh").read_text()
    with pytest.raises(ValueError, match="by-path"):
        cells[0].placement(baseline=True)
    for backend, option, why in (("sim", 'offload = "ngl-2"', "experts on the host"), ("cpu", "", "GPU-like backend"),
                                 ("sim", "parallel = 0", "whole number of sequences")):
        bad = load_matrix(_matrix_file(tmp_path, f'[[cells]]\nmodel = "m"\nbackend = "{backend}"\n'
                                                 f'baseline_offload = "by-path"\n{option}\n'))
        with pytest.raises(UserError, match=why):
            bad.cells()
