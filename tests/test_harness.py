"""End to end on the CPU builds: the identity subset CI runs, the runner's bad inputs, the A/B bench."""

import json
import os
import re
import subprocess
import sys

import pytest

from pyllama_moe.errors import UserError
from pyllama_moe.harness import runner
from pyllama_moe.paths import CI_DIR, PROJECT_ROOT


def _cli(*args, timeout=1800, env_extra=None):
    env = {**os.environ, **env_extra} if env_extra else None
    return subprocess.run([sys.executable, "-m", "pyllama_moe", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_ci_subset_passes_and_the_negative_control_is_a_mismatch(master_build, patched_build, tmp_path):
    out = tmp_path / "compare.json"
    proc = _cli("compare", "--baseline", "master", "--candidate", "patched", "--subset", "ci", "--json", str(out))
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    cells = report["cells"]
    identity = [c for c in cells if c["cell"]["expect"] == "identical"]
    assert len(identity) >= 7 and all(c["status"] == "pass" for c in identity)
    assert {c["cell"]["model"] for c in identity} == {"qwen3moe", "glm4moe", "qwen3moe-split", "gpt-oss"}
    assert {c["cell"]["backend"] for c in identity} == {"cpu", "sim", "sim2"}
    for cell in identity:
        checks = {c["name"]: c for c in cell["checks"]}
        sim = cell["cell"]["backend"] != "cpu"
        expected = {"logits", "text", "decode-logits"} | ({"perplexity"} if cell["cell"]["perplexity"] else set())
        expected |= {"sim-races"} if sim else set()
        # experts on the host of a SIM cell with mmap: they must have been page-locked in place
        expected |= {"pinned"} if sim and cell["cell"]["load"] == "mmap" and cell["cell"]["offload"] != "all" else set()
        # with the prefetch forced on (the prefetch knobs, and the cache's, whose prompts stage through it), a sim cell
        # also proves the copies went ahead (or, below the batch, did not)
        knobs = cell["cell"]["knobs"]
        expected |= {"prefetch"} if sim and knobs.startswith(("prefetch", "moe-cache", "layer-major")) else set()
        if knobs.startswith("layer-major"):
            # the cells that cut the layers into groups really ran the prompt group by group
            expected |= {"layer-major"}
            assert checks["logits"]["detail"]["layer_major_calls"] == checks["layer-major"]["detail"]["calls"] == 1
        # with the expert cache on, banks were made, decode read them (on the device, or with moe-cache-host through
        # the host-side plan), and prompts that upload ahead staged through it
        expected |= {"cache"} if knobs in ("moe-cache", "moe-cache-single", "moe-cache-host", "moe-cache-whole",
                                           "moe-cache-whole-routed", "moe-cache-split-ops", "moe-cache-seed-off",
                                           "moe-cache-half", "moe-cache-10-slots", "moe-cache-poison",
                                           "moe-cache-probe-below", "moe-cache-probe-lookup",
                                           "moe-cache-async") else set()
        if knobs == "moe-cache-split-ops":
            assert checks["cache"]["detail"]["decode_path"] == "mixed"
        if knobs == "moe-cache-probe-below":
            # 15 of 16 slots in every layer: no layer whole, each decode step looked up with a few misses
            detail = checks["cache"]["detail"]
            assert not detail["whole"] and detail["in_place"] == 0 and detail["misses"] > 0
            assert detail["decode_path"] == "device"
        if knobs == "moe-cache-probe-lookup":
            # filled whole, never read in place: every decode step looked up, all hits
            detail = checks["cache"]["detail"]
            assert detail["whole"] and detail["filled_whole"] == 4 and detail["in_place"] == 0
            assert detail["misses"] == 0 and detail["hits"] > 0 and detail["decode_path"] == "device"
        # parallel sequences: each cached layer's paths against the slots, and the reference they named
        parallel = cell["cell"]["parallel"]
        expected |= {"cache-paths"} if parallel > 1 else set()
        assert bool(cell["reference"]) == (cell["cell"]["baseline_offload"] == "by-path")
        assert set(checks) == expected and all(c["identical"] for c in checks.values())
        assert checks["logits"]["detail"]["positions"] == 600
        generate = cell["cell"]["generate"]
        # the prompt's argmax, then one per sequence and step
        assert checks["text"]["detail"]["tokens"] == 1 + (generate - 1) * parallel
        assert checks["decode-logits"]["detail"]["steps"] == generate - 1
    # the parallel cells named each reference at least once: master --cpu-moe, all on the GPU, and an -ot rule (the
    # 3 MiB cache's 7-8 slots at 2 sequences); their own paths are tests/test_moe_cache_parallel.py's
    refs = {(c["cell"]["knobs"], c["cell"]["parallel"]): c["reference"] for c in identity if c["reference"]}
    assert {r["reference"] for r in refs.values()} == {"all", "cpu-moe", "-ot"}
    assert refs[("moe-cache-half", 2)]["reference"] == "-ot" and refs[("moe-cache-10-slots", 2)]["reference"] == "all"
    assert all(r["reference"] == "cpu-moe" for (knobs, n), r in refs.items() if n > 2 or knobs == "moe-cache")
    controls = {c["cell"]["name"]: c for c in cells if c["cell"]["expect"] == "mismatch"}
    assert set(controls) == {"control/repack-on-vs-off", "control/sim-skip-wait", "control/sim-moe-cache-stale",
                             "control/sim-moe-cache-host-stale", "control/sim-moe-cache-whole-stale",
                             "control/sim-async-cpu-unsafe"}
    for name, control in controls.items():
        assert control["status"] == "pass"
        checks = {c["name"]: c for c in control["checks"]}
        if name in ("control/sim-moe-cache-stale", "control/sim-moe-cache-host-stale"):
            # decode on the device: the first fill of every lookup of the first cached layer is left out; with the
            # host-side plan the 50th fill (the prompt's one ubatch ahead admits 20 experts): both are decode fills
            assert checks["logits"]["identical"] and not checks["decode-logits"]["identical"]
            assert checks["cache"]["identical"]
            want = "device" if name == "control/sim-moe-cache-stale" else "host"
            assert checks["cache"]["detail"]["decode_path"] == want
            continue
        if name == "control/sim-moe-cache-whole-stale":
            # the 3rd fill, left stale, is one of layer 0's when the cache was filled whole, read in place by every graph
            assert checks["cache"]["identical"] and checks["cache"]["detail"]["filled_whole"] == 4
        assert not checks["logits"]["identical"]
        assert checks["logits"]["detail"]["first_diff_pos"] is not None
    repack = next(c for c in controls["control/repack-on-vs-off"]["checks"] if c["name"] == "logits")["detail"]
    assert repack["max_abs"] > 0 and 0 <= repack["top1_agreement"] <= 1 and repack["mean_kld"] > 0


def test_runner_refuses_missing_and_truncated_models(patched_build, src, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        runner.run(patched_build, src, runner.RunSpec(model=tmp_path / "nope.gguf", prompt="x"))
    from pyllama_moe.harness import models
    from pyllama_moe.harness.matrix import load_matrix
    from pyllama_moe.paths import CI_DIR

    good = models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(UserError, match="truncated"):
        runner.run(patched_build, src, runner.RunSpec(model=cut, prompt="x"))


def test_bench_reports_a_ratio_with_an_interval_per_test(master_build, patched_build, tmp_path):
    out = tmp_path / "bench.json"
    proc = _cli("bench", "--synth", "qwen3moe", "--rounds", "2", "--warmup-rounds", "0", "--reps", "2", "--discard", "1",
                "--json", str(out), "--", "-p", "64", "-n", "4", "-t", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| pp64 ub512" in proc.stdout and "| tg4 ub512" in proc.stdout and "ratio [95% CI]" in proc.stdout
    assert "CV between processes" in proc.stdout and "stopped: 2 rounds" in proc.stdout
    tests = json.loads(out.read_text())["tests"]
    assert len(tests) == 2
    for t in tests:
        assert len(t["samples"]) == 2 * 2 * 2  # rounds x builds x reps, the warm-up ones marked
        assert sum(s["discarded"] for s in t["samples"]) == 4
        assert t["n_pairs"] == 2 and t["ci_low"] <= t["ratio"] <= t["ci_high"]


def test_bench_and_run_take_the_cache_budget_and_show_its_hit_rate(master_build, patched_build, tmp_path):
    # the candidate on one SIM device with every expert on the host and a 2 MiB cache; master has no SIM device and
    # no cache (its rows carry no hit rate)
    out = tmp_path / "bench.json"
    proc = _cli("bench", "--synth", "qwen3moe", "--rounds", "2", "--warmup-rounds", "0", "--reps", "2", "--discard", "1",
                "--moe-cache-mib", "2", "--candidate-env", "GGML_SIM_DEVICES=1", "--json", str(out),
                "--", "-p", "0", "-n", "8", "-t", "2", "-ngl", "99", "-ncmoe", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hit rate, patched |" in proc.stdout.splitlines()[0]
    assert "hit rate per layer (%), tg8 ub512 ngl99 ncmoe4" in proc.stdout and "cold (first repetitions)" in proc.stdout
    (test,) = json.loads(out.read_text())["tests"]
    assert list(test["hit_rate"]) == ["candidate"] and sorted(test["hit_rate"]["candidate"]["layers"]) == ["0", "1", "2", "3"]
    assert json.loads(out.read_text())["meta"]["env"]["candidate"]["LLAMA_MOE_CACHE_MIB"] == "2"
    from pyllama_moe.harness import models
    from pyllama_moe.harness.matrix import load_matrix

    model = models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])
    assert "needs the patched build" in _cli("run", "--variant", "master", "--moe-cache-mib", "2", str(model)).stderr
    run = _cli("run", "--variant", "patched", "--no-build", "-cmoe", "-mcm", "2", "-n", "16", str(model),
               env_extra={"GGML_SIM_DEVICES": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"expert cache, decode: \d+ layer steps, hit rate \d+\.\d%", run.stdout), run.stdout


def test_the_pinned_check_tells_a_whole_pin_from_a_partial_one():
    from pyllama_moe.harness.compare import pin_check

    whole = "0.01 I llama_moe: 6.38 MiB of expert weights registered with SIM0 (page-locked in place: 1 range(s), 7.03 MiB)"
    part = ("0.02 W llama_moe: 3.20 MiB of 7.03 MiB of expert ranges registered with SIM0 (page-locked in place: "
            "2 range(s)); the rest stays pageable: 4.00 MiB of page-locked memory fit, the budget of "
            "LLAMA_MOE_PIN_BUDGET_MIB / --pin-budget, at most 23.11 GiB available less a 2.00 GiB margin")
    copied = "0.03 I llama_moe: 6.38 MiB of expert weights copied into pinned memory (SIM_Host): registration failed"
    assert pin_check(whole).identical and not pin_check(part).identical and not pin_check(copied).identical
    # under the pin-budget knob's 4 MiB, part of the ranges in place, or all of them where they fit in it
    assert pin_check(part, budget_mib=4).identical and not pin_check(whole, budget_mib=4).identical
    assert pin_check(part, budget_mib=4).detail["ranges"] == 2
    assert not pin_check(copied, budget_mib=4).identical
    assert pin_check(whole, budget_mib=7.03).identical and not pin_check(whole, budget_mib=7).identical
    # the line of the first CUDA run of the knob (qwen3moe, -ncmoe 2): its whole 3.41 MiB range fits in 4 MiB
    small = "0.05 I llama_moe: 3.19 MiB of expert weights registered with CUDA0 (page-locked in place: 1 range(s), 3.41 MiB)"
    assert pin_check(small, budget_mib=4).identical and not pin_check(small, budget_mib=3).identical
    assert not pin_check(small.replace("3.41 MiB)", "1.10 GiB)"), budget_mib=4).identical
    none_fit = ("0.04 W llama_moe: 3.19 MiB of expert weights left pageable: not one range of them fits the 4.00 MiB "
                "of page-locked memory allowed, the budget of LLAMA_MOE_PIN_BUDGET_MIB / --pin-budget, at most ...")
    assert pin_check(none_fit, budget_mib=4).identical and not pin_check(none_fit).identical
    unbudgeted = none_fit.replace("the budget of LLAMA_MOE_PIN_BUDGET_MIB / --pin-budget", "the memory available")
    assert not pin_check(unbudgeted, budget_mib=4).identical


def test_the_cache_check_wants_banks_and_decode_steps_with_misses():
    from pyllama_moe.harness.compare import cache_check, pin_check

    made = ("0.01 I llama_moe: expert cache on SIM0: 1.99 MiB, 4 MoE layers with their experts on the host, 5-5 of 16 "
            "expert slots each; graphs of up to 32 tokens read them (LLAMA_MOE_CACHE_DECODE_MAX)")
    summary = ("0.02 I llama_moe: expert cache, decode: 1198 layer steps, 1498 hits, 3294 misses (hit rate 31.3%), "
               "0 on the staging path, 328.11 MiB uploaded in 9636 copies, 0 read in place")
    check = cache_check(made + "\n" + summary)
    assert check.identical and check.detail == {"devices": ["SIM0"], "decode_path": "mixed", "whole": False,
                                                "filled_whole": 0, "layer_steps": 1198, "hits": 1498, "misses": 3294, "in_place": 0,
                                                "prompt_ubatches_ahead": 0, "prompt_layer_steps": 0, "prompt_reads": 0,
                                                "prompt_fills": 0, "layer_major_calls": 0, "probe": 0}
    # the decode path the cell asked for, by the context's line per device: a cell that wanted the device lookup and
    # got the host-side plan (or no line at all) fails, and the other way round
    device = "0.01 I llama_moe: expert cache on SIM0: decode looks up its slots and fills its misses on the device"
    host = ("0.01 I llama_moe: expert cache on SIM0: decode plans 4 of 4 layers on the host (a synchronization per "
            "layer): LLAMA_MOE_CACHE_DEVICE=0")
    assert cache_check("\n".join([made, device, summary]), want_device=True).detail["decode_path"] == "device"
    assert cache_check("\n".join([made, device, summary]), want_device=True).identical
    assert not cache_check("\n".join([made, device, summary]), want_device=False).identical
    assert cache_check("\n".join([made, host, summary]), want_device=False).identical
    assert not cache_check("\n".join([made, host, summary]), want_device=True).identical
    assert not cache_check(made + "\n" + summary, want_device=True).identical
    assert not cache_check(summary).identical  # no banks: the text came from somewhere else
    assert not cache_check(made).identical     # banks, but no summary of decode steps
    assert not cache_check(made + "\n" + summary.replace("3294 misses", "0 misses")).identical
    # prompt ubatches that upload ahead: the cache must have staged them and made experts resident, and have read
    # residents from the banks once there was a second such ubatch
    prompts = ("0.02 I llama_moe: expert cache, prompts: 8 layer steps, 20 experts read from the banks, 108 uploaded "
               "(10.5 MiB), 20 made resident, 3.9 MiB copied on the device, 40 copies, 0 read in place")
    assert cache_check("\n".join([made, summary, prompts]), ubatches_ahead=2).identical
    assert not cache_check("\n".join([made, summary]), ubatches_ahead=1).identical  # the host weights were uploaded
    assert not cache_check("\n".join([made, summary, prompts.replace("20 made", "0 made")]), ubatches_ahead=1).identical
    assert not cache_check("\n".join([made, summary, prompts.replace(" 20 experts", " 0 experts")]), ubatches_ahead=2).identical
    assert not cache_check("\n".join([made, summary, prompts]), ubatches_ahead=0).identical  # a prompt nobody expected
    # a layer-major call writes each layer's copies once, in its first ubatch: a fresh cache has nothing to read then
    layer_major = ("0.02 I llama_moe: layer-major prompt: 600 tokens in 5 ubatches, 1 layer group: 6.4 MiB of host "
                   "weights uploaded, 19.1 MiB found kept in place")
    unread = prompts.replace(" 20 experts", " 0 experts")
    assert cache_check("\n".join([made, summary, unread, layer_major]), ubatches_ahead=4).identical
    assert not cache_check("\n".join([made, summary, unread.replace("20 made", "0 made"), layer_major]),
                           ubatches_ahead=4).identical
    # a layer with fewer slots than experts is never read in place: a summary that says so is wrong
    assert not cache_check(made + "\n" + summary.replace("0 read in place", "4 read in place")).identical
    # the cache's lines are not the pin's: the pin check still sees its one line
    pinned = "0.00 I llama_moe: 6.38 MiB of expert weights registered with SIM0 (page-locked in place: 1 range(s), 7.03 MiB)"
    assert pin_check("\n".join([pinned, made, summary])).identical


def test_the_cache_check_of_a_whole_cache_wants_layers_read_in_place():
    from pyllama_moe.harness.compare import cache_check

    made = ("0.01 I llama_moe: expert cache on SIM0: 6.39 MiB, 4 MoE layers with their experts on the host, 16-16 of 16 "
            "expert slots each; graphs of up to 8 tokens read them (LLAMA_MOE_CACHE_DECODE_MAX)")
    decode = ("0.02 I llama_moe: expert cache, decode: 36 layer steps, 0 hits, 0 misses (hit rate 0.0%), 0 on the "
              "staging path, 0.00 MiB uploaded in 0 copies, 36 read in place")
    prompts = ("0.02 I llama_moe: expert cache, prompts: 16 layer steps, 0 experts read from the banks, 64 uploaded "
               "(6.38 MiB), 64 made resident, 6.38 MiB copied on the device, 24 copies, 12 read in place")
    check = cache_check("\n".join([made, decode, prompts]), ubatches_ahead=4)
    assert check.identical and check.detail["whole"] and check.detail["in_place"] == 48
    # nothing read in place: the banks were never the image of the experts
    assert not cache_check("\n".join([made, decode.replace("36 read", "0 read"), prompts.replace("12 read", "0 read")]),
                           ubatches_ahead=4).identical
    # prompt ubatches uploaded ahead but made nothing resident
    assert not cache_check("\n".join([made, decode, prompts.replace("64 made", "0 made")]), ubatches_ahead=4).identical
    missed = decode.replace("0 hits, 0 misses", "30 hits, 6 misses")
    assert cache_check("\n".join([made, missed]), ubatches_ahead=0).identical  # decode filled it, then read it in place
    # two devices, one with fewer slots than experts: not a whole cache, so it must also show the evicting decode
    # plan; a layer of the other may be read in place
    other = made.replace("SIM0", "SIM1").replace("16-16 of 16", "5-5 of 16")
    both = cache_check("\n".join([made, other, missed, prompts.replace("0 experts read", "8 experts read")]), ubatches_ahead=2)
    assert both.identical and not both.detail["whole"]
    # ... where no device has a slot per expert, nothing may be read in place
    small = other.replace("SIM1", "SIM0")
    assert not cache_check("\n".join([small, other, missed, prompts.replace("0 experts read", "8 experts read")]),
                           ubatches_ahead=2).identical


def test_the_cache_check_of_a_cache_filled_whole_wants_nothing_left_to_admit():
    from pyllama_moe.harness.compare import cache_check

    made = ("0.01 I llama_moe: expert cache on SIM0: 6.39 MiB, 4 MoE layers with their experts on the host, 16-16 of 16 "
            "expert slots each; graphs of up to 8 tokens read them (LLAMA_MOE_CACHE_DECODE_MAX); 4 layers with a slot "
            "per expert, read in place (filled whole now)")
    filled = ("0.01 I llama_moe: expert cache: 4 layers with a slot per expert filled whole, 6.38 MiB in 0.01 s (0.7 GB/s); "
              "LLAMA_MOE_CACHE_FILL_WHOLE=0 fills them as decode routes to them")
    decode = ("0.02 I llama_moe: expert cache, decode: 36 layer steps, 0 hits, 0 misses (hit rate 0.0%), 0 on the "
              "staging path, 0.00 MiB uploaded in 0 copies, 36 read in place")
    prompts = ("0.02 I llama_moe: expert cache, prompts: 16 layer steps, 0 experts read from the banks, 0 uploaded "
               "(0.00 MiB), 0 made resident, 0.00 MiB copied on the device, 0 copies, 16 read in place")
    check = cache_check("\n".join([made, filled, decode, prompts]), ubatches_ahead=4)
    assert check.identical and check.detail["filled_whole"] == 4 and check.detail["in_place"] == 52
    # filled whole, yet a prompt made experts resident: the layers were not whole after all
    assert not cache_check("\n".join([made, filled, decode, prompts.replace("0 made", "8 made")]), ubatches_ahead=4).identical
    assert not cache_check("\n".join([made, filled, decode.replace("36 read", "0 read"),
                                      prompts.replace("16 read", "0 read")]), ubatches_ahead=4).identical
    # without the line the same prompt counters are those of a cache filled as routed whose prompt admitted nothing
    assert not cache_check("\n".join([made, decode, prompts]), ubatches_ahead=4).identical

