"""--fit and layer-major prompts: --fit keeps the staging of two layer groups free on the device that stages host
weights (two one-layer groups of the model's experts, or the budget set), so a fitted context's long prompts run layer
group by layer group. Before, --fit filled the device to its target and the auto budget (half of what was free beyond
the prefetch headroom) could not hold one layer: such contexts kept ubatch order.

llama.cpp's tools of the patched CPU build on a SIM device with little memory (fit_tools.py). The model's layers hold
12.75 MiB of experts each (three 4.25 MiB tensors) and a little more of feed-forward tensors (the router, the norm), so
the least staging is a little over 2 x 12.75 = 25.5 MiB: a budget of 26 MiB, kept as 26 + 1 MiB (plus a MiB for the
device's padding); the target is 16 MiB and the prefetch headroom 4 MiB, so without
the reservation the auto budget is about (16 - 4) / 2 = 6 MiB.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from fit_tools import corpus, model, prompt  # noqa: F401 (fixtures)
from fit_tools import TARGET_MIB, base_env, fit_args, free_at_exit, generate, model_on_device, run_tool

SIM = {"GGML_SIM_DEVICES": "1", "GGML_SIM_MEMORY_MIB": "96", "GGML_SCHED_PREFETCH": "2",
       "GGML_SCHED_PREFETCH_HEADROOM_MIB": "4", "GGML_SCHED_PREFETCH_MIN_BATCH": "32"}
KEPT = re.compile(r"layer-major prompts: (\d+) MiB kept free on (SIM\d) for the staging of two layer groups \(([^)]*)\)")
PLANNED = re.compile(r"layer-major prompts: (\d+) layer groups? of the 6 layers.*a group's budget on SIM0 \(of the host "
                     r"weights\): ([0-9.]+) of ([0-9.]+) MiB \(([^)]*)\)")
CALL = re.compile(r"layer-major prompt: (\d+) tokens in (\d+) ubatches, (\d+) layer groups?")


def test_fit_keeps_two_layer_groups_free_and_the_prompt_runs_layer_major(patched_build, model, prompt):
    _, log = generate(patched_build, model, prompt, SIM, *fit_args())
    kept = KEPT.search(log)
    assert kept and kept.group(1) == "27" and kept.group(2) == "SIM0", log[-3000:]
    planned = PLANNED.search(log)
    assert planned, log[-3000:]
    # one layer a group: half the 26 MiB budget holds one layer's 12.75 MiB of experts, not two
    assert float(planned.group(2)) == 13.0 and planned.group(4) == "of the staging --fit kept free", planned.group(0)
    assert int(planned.group(1)) >= 2, planned.group(0)
    call = CALL.search(log)
    assert call and int(call.group(2)) >= 2 and int(call.group(3)) == int(planned.group(1)), log[-3000:]
    assert "more than a layer group may stage" not in log and "staging arena could not be made" not in log
    # the staging was kept: fewer weights on the device than where layer-major prompts are off
    _, off = generate(patched_build, model, prompt, SIM, *fit_args("--layer-major-prompt", "0"))
    assert model_on_device(log) < model_on_device(off) - 20, (model_on_device(log), model_on_device(off))
    assert free_at_exit(log)["SIM0"] >= TARGET_MIB, free_at_exit(log)


def test_with_two_devices_every_group_takes_the_budget_of_the_device_that_stages_it(patched_build, model, prompt):
    """Two SIM devices, both too small for their layers' experts. The scheduler offloads every op that reads a host
    weight to SIM0, whose prefetch stages every group's copies, and --fit keeps the staging free there; --fit fills
    SIM1 to its target. Before, each group's budget was its layers' own device's: SIM1's half of its 16 MiB beyond the
    headroom could not hold a layer, and the context kept ubatch order."""
    two = {**SIM, "GGML_SIM_DEVICES": "2", "GGML_SIM_MEMORY_MIB": "72,40"}
    text, log = generate(patched_build, model, prompt, two, *fit_args())
    kept = KEPT.search(log)
    assert kept and kept.group(1) == "27" and kept.group(2) == "SIM0", log[-3000:]
    sim1 = re.findall(r"common_params_fit_impl:\s+- SIM1 .*?(\d+) layers \(\s*(\d+) overflowing\)", log)
    assert sim1 and int(sim1[-1][1]) > 0, "no layer of SIM1 keeps experts on the host"
    assert free_at_exit(log)["SIM1"] < TARGET_MIB + 4, free_at_exit(log)
    planned = PLANNED.search(log)
    assert planned and planned.group(4) == "of the staging --fit kept free" and int(planned.group(1)) >= 2, log[-3000:]
    call = CALL.search(log)
    assert call and int(call.group(3)) == int(planned.group(1)), log[-3000:]
    assert "more than a layer group may stage" not in log and "staging arena could not be made" not in log
    # the groups hold the host weights of both devices' layers: more than SIM0's layers keep on the host
    on_sim0 = re.findall(r"common_params_fit_impl:\s+- SIM0 .*?(\d+) layers \(\s*(\d+) overflowing\)", log)
    assert float(planned.group(3)) > 12.75 * int(on_sim0[-1][1]), (planned.group(0), on_sim0)
    # SIM computes with the CPU's kernels wherever a weight is: the text of ubatch order
    off_text, _ = generate(patched_build, model, prompt, two, *fit_args("--layer-major-prompt", "0"))
    assert text == off_text


def test_fit_keeps_the_staging_on_the_device_that_takes_the_ops_on_host_weights(patched_build, model, prompt):
    """SIM0 takes no op on host weights (as an RPC device ahead of the GPUs): the scheduler offloads the products of
    host experts to SIM1, whose prefetch stages them, so --fit keeps the staging free there and the context plans
    with it. Before, --fit kept it on SIM0, the first device whose prefetch was on."""
    env = {**SIM, "GGML_SIM_DEVICES": "2", "GGML_SIM_MEMORY_MIB": "40,72", "GGML_SIM_NO_OFFLOAD": "0"}
    _, log = generate(patched_build, model, prompt, env, *fit_args())
    kept = KEPT.search(log)
    assert kept and kept.group(1) == "27" and kept.group(2) == "SIM1", log[-3000:]
    planned = re.search(r"layer-major prompts: (\d+) layer groups? .*a group's budget on SIM1 .*\((of [^)]*)\); calls", log)
    assert planned and planned.group(2) == "of the staging --fit kept free" and int(planned.group(1)) >= 2, log[-3000:]
    assert CALL.search(log) and "staging arena could not be made" not in log


def test_fit_keeps_nothing_where_no_device_takes_the_ubatches_host_experts(patched_build, model, prompt):
    # SIM offloads from 512 tokens, the ubatch is 256: the CPU computes the host experts
    _, log = generate(patched_build, model, prompt, {**SIM, "GGML_OP_OFFLOAD_MIN_BATCH": "512"}, *fit_args())
    assert "no staging kept free: no device computes host experts at -ub 256 (the CPU does)" in log, log[-3000:]
    assert not KEPT.search(log)


def test_fit_computes_the_same_log_probs_as_without_layer_major_prompts(patched_build, model, corpus, tmp_path):
    """Off, --fit keeps nothing for layer groups and places more of the experts on the device; the perplexity log-probs
    are the same bytes (SIM computes with the CPU's kernels wherever a weight is). Chunks of 512 tokens at ub 256: each
    is a call of two ubatches."""
    common = ["-m", str(model), "-f", str(corpus), "-c", "512", "-b", "512", "-ub", "256", "--chunks", "2", "-t", "2",
              "--no-warmup", "-v", *fit_args()]
    on = run_tool(patched_build, "llama-perplexity", [*common, "--kl-divergence-base", str(tmp_path / "on.kld")], SIM)
    off = run_tool(patched_build, "llama-perplexity", [*common, "--layer-major-prompt", "0", "--kl-divergence-base",
                                                       str(tmp_path / "off.kld")], SIM)
    assert KEPT.search(on) and CALL.search(on), on[-3000:]
    assert "layer-major prompts: no staging kept free: layer-major prompts are off" in off
    assert not KEPT.search(off) and not CALL.search(off)
    assert (tmp_path / "on.kld").read_bytes() == (tmp_path / "off.kld").read_bytes()


def test_a_set_budget_is_what_fit_keeps_free(patched_build, model, prompt):
    _, log = generate(patched_build, model, prompt, SIM, *fit_args("--layer-major-staging", "40"))
    kept = KEPT.search(log)
    assert kept and kept.group(1) == "41" and kept.group(3).startswith("the budget set;"), log[-3000:]
    planned = PLANNED.search(log)
    assert planned and planned.group(4) == "of the budget set", log[-3000:]
    assert CALL.search(log)
    assert free_at_exit(log)["SIM0"] >= TARGET_MIB


def test_a_device_without_room_beside_the_layers_keeps_no_staging(patched_build, model, prompt):
    """At 56 MiB the layers without their experts and the target leave 21 MiB, less than the 27 MiB of staging: kept,
    it would push every layer off the device for groups that then have nothing to stage. --fit places the layers as
    with layer-major prompts off (before: no layer on the device)."""
    small = {**SIM, "GGML_SIM_MEMORY_MIB": "56"}
    _, log = generate(patched_build, model, prompt, small, *fit_args())
    assert re.search(r"no staging kept free: with every expert on the host, SIM0 has \d+ MiB of room, less than the 27 "
                     r"MiB of the staging", log), log[-3000:]
    _, off = generate(patched_build, model, prompt, small, *fit_args("--layer-major-prompt", "0"))
    assert model_on_device(log) == model_on_device(off) > 0, (model_on_device(log), model_on_device(off))


def test_experts_the_user_keeps_on_the_host_get_the_staging_too(patched_build, model, prompt):
    # --cpu-moe: --fit only checks (and may shrink) the context, with the staging in its target
    _, log = generate(patched_build, model, prompt, SIM, *fit_args("--cpu-moe"))
    kept = KEPT.search(log)
    assert kept and kept.group(1) == "27" and "for the experts kept on the host" in kept.group(3), log[-3000:]
    assert CALL.search(log), log[-3000:]


@pytest.mark.parametrize("memory, args, why", [
    ("60", ["--cpu-moe"], r"with the context set, SIM0 has \d+ MiB of room, less than the 27 MiB of the staging"),
    ("200", ["-ot", "exps=SIM0"], r"the tensor overrides keep no layer's experts on the host"),
], ids=["no-room-beside-a-context-set", "no-host-experts"])
def test_user_overrides_keep_nothing_where_it_cannot_be_used(patched_build, model, prompt, memory, args, why):
    # a context the user set is not shrunk for the staging (before: the fit failed where the staging did not fit
    # beside it, and kept staging for overrides that leave nothing on the host)
    _, log = generate(patched_build, model, prompt, {**SIM, "GGML_SIM_MEMORY_MIB": memory}, *fit_args(*args))
    assert re.search("no staging kept free: " + why, log), log[-3000:]
    assert not KEPT.search(log) and "failed to fit" not in log


def test_a_call_of_one_ubatch_keeps_nothing_free(patched_build, model, corpus, tmp_path):
    # the context clamps -b to -c: a 256-token context computes one ubatch of 256 a call, whatever -b says
    short = tmp_path / "short.txt"
    short.write_text(corpus.read_text()[:300])
    log = run_tool(patched_build, "llama-completion", ["-m", str(model), "-f", str(short), "-n", "8", "--temp", "0",
                                                       "-no-cnv", "-c", "256", "-b", "2048", "-ub", "256", "-t", "2", "-v",
                                                       *fit_args()], SIM)
    assert "no staging kept free: a prompt call cannot hold two ubatches of at least the prefetch's min batch (32 " \
           "tokens): -b 256, -ub 256" in log, log[-3000:]
    assert not KEPT.search(log)


def test_a_later_llama_bench_test_without_a_fit_does_not_inherit_the_staging(patched_build, model):
    # -fitt 16,0: the first test fits, the second does not (0 is llama-bench's "no fit") and keeps every expert on the
    # host (-ncmoe 6), where the staging the first test's fit kept is not free
    out = run_tool(patched_build, "llama-bench", ["-m", str(model), "-p", "512", "-n", "0", "-b", "512", "-ub", "256",
                                                  "-r", "1", "-t", "2", "-ncmoe", "6", "-fitt", "16,0", "-v"], SIM)
    # the first context plans with the staging its fit kept; the second one's auto budget is half its free memory,
    # which cannot hold a layer (before: the first fit's staging, which the second test's placement did not keep free,
    # and a second plan like the first)
    assert [p[3] for p in PLANNED.findall(out)] == ["of the staging --fit kept free"], out[-3000:]
    assert out.count("more than a layer group may stage") == 1, out[-3000:]


def test_a_set_budget_below_two_layers_keeps_nothing_free(patched_build, model, prompt):
    _, log = generate(patched_build, model, prompt, SIM, *fit_args("--layer-major-staging", "20"))
    assert "no staging kept free: the staging budget set cannot hold two groups of the largest layer" in log
    assert not KEPT.search(log)


def test_the_expert_cache_counts_the_shared_arena_at_the_larger_size(patched_build, model, prompt):
    # the cache's prompt prefetch stages 4 x 4.25 = 17 MiB in the arena layer-major prompts grow to 27 MiB
    _, log = generate(patched_build, model, prompt, SIM, *fit_args("--moe-cache-mib", "1000"))
    plan = next(line for line in log.splitlines() if "common_fit_moe_cache: " in line and "getting" not in line)
    assert re.search(r"SIM0 \d+ MiB of cache \(27 MiB of staging", plan), plan
    assert CALL.search(log), log[-3000:]
    assert free_at_exit(log)["SIM0"] >= TARGET_MIB, free_at_exit(log)


def test_llama_fit_params_prints_the_staging_budget(src, model):
    # a run with the printed arguments and no --fit finds the staging budget --fit planned with
    from pyllama_moe.build.builder import resolve

    build = resolve("patched", "cpu", targets=("llama-fit-params",))
    proc = subprocess.run([str(build.tool("llama-fit-params")), "-m", str(model), "-c", "1024", "-ub", "256", "-fitt",
                           str(TARGET_MIB)], capture_output=True, text=True, timeout=300, env={**base_env(), **SIM})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.fullmatch(r'-c 1024 -ngl \d+ -ot "[^"]*=CPU[^"]*" --layer-major-staging 26', proc.stdout.strip()), proc.stdout
