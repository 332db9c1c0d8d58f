"""The server soak (pyllama_moe/harness/server_soak.py).

Its checks are tested on data first (probe rounds, which probes docs/cache-paths.md says equal all on
the GPU, memory growth, bad input); then a short soak of the patched llama-server on one SIM device (4 slots,
experts on the host, the cache at a quarter of the expert bytes, the synthetic LoRA adapter of synth/lora.py loaded:
the run that shows llama.cpp loads it), and the same with the adapter's scale left changed for the later probe
rounds, which must fail them.
"""
from __future__ import annotations

import json

import pytest

from pyllama_moe.cli.main import main
from pyllama_moe.harness.server_soak import (PROBES, SoakConfig, all_gpu_guaranteed, cache_facts, memory_check,
                                             round_differences, run)

# the line the cache logs when made (native/src/llama-moe-cache-rt.cpp), as the tiny model's 2 MiB cache says it
BANKS_LINE = ("llama_moe: expert cache: graphs of up to 1 token read the banks of every cached layer; larger ones leave "
              "them in the 4 layers not read in place (fewer slots than tokens x top-k: the staging path up to 8 tokens, "
              "the host path above), which compute their experts on the CPU below 32 tokens (GGML_OP_OFFLOAD_MIN_BATCH) "
              "and upload them from there (docs/cache-paths.md)")


def test_a_probe_whose_bytes_change_is_named_with_where():
    first = ['{"content": "a b c", "probs": [1.5]}', '{"content": "x", "probs": [2.0]}']
    assert round_differences(first, list(first)) == []
    later = [first[0], '{"content": "x", "probs": [2.5]}']
    (line,) = round_differences(first, later)
    assert line.startswith("probe 1: differs from the first round at character 29")


def test_only_probes_on_gpu_paths_are_held_to_all_on_gpu_bytes():
    facts = cache_facts("0.05 I " + BANKS_LINE + "\n")
    assert (facts["banks_up_to"], facts["offload_min"]) == (1, 32)
    assert all_gpu_guaranteed(100, 1, 32)[0] and all_gpu_guaranteed(1, 1, 32)[0]
    assert all_gpu_guaranteed(513, 1, 32)[0]  # 512 staged on the GPU, the last token reads the banks
    assert not all_gpu_guaranteed(24, 1, 32)[0]  # experts on the CPU (host path)
    assert not all_gpu_guaranteed(520, 1, 32)[0]  # a last ubatch of 8 tokens: the staging path, on the CPU
    assert all_gpu_guaranteed(520, 8, 32)[0]  # ... unless 8 tokens read the banks
    assert not all_gpu_guaranteed(100, None, None)[0]  # no cache line: nothing is promised
    assert cache_facts("every cached layer holds all its experts")["banks_up_to"] > 1 << 40


def test_memory_growth_after_the_first_pause_is_bounded():
    config = SoakConfig(server=None, model=None, out=None, rss_growth_mib=64, rss_growth_pct=10, vram_growth_mib=64)

    def samples(rss, vram):
        phases = ["start", "soak", "pause", "soak", "end"]
        return [{"t": i, "phase": p, "RssAnon": r, "vram_mib": v} for i, (p, r, v) in enumerate(zip(phases, rss, vram))]

    # the warm-up before the first pause may grow as it likes; after it, 64 MiB or 10%
    assert memory_check(config, samples([100, 900, 1000, 1090, 1050], [10, 500, 600, 650, 600]))["flat"] is True
    grew = memory_check(config, samples([100, 900, 1000, 1101, 1050], [10, 500, 600, 600, 600]))
    assert grew["flat"] is False and grew["verdict"].startswith("GREW")
    assert memory_check(config, samples([100, 900, 1000, 1000, 1000], [10, 500, 600, 665, 600]))["flat"] is False
    no_pause = [s for s in samples([1] * 5, [1] * 5) if s["phase"] != "pause"]
    assert memory_check(config, no_pause)["flat"] is None


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"not a model")
    assert main(["server-soak", "--server", str(tmp_path), "--model", str(model), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not an executable file" in err[0]
    with pytest.raises(SystemExit) as exc:
        main(["server-soak", "--server", str(tmp_path), "--model", str(model), "--out", str(tmp_path), "--slots", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--slots" in err[0]


# --- on a SIM device ---------------------------------------------------------------------------------------

def _config(build, model, out, **kw) -> SoakConfig:
    return SoakConfig(server=build.bin_dir / "llama-server", model=model, out=out, slots=4, threads=1,
                      env={"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1"}, **kw)


@pytest.mark.build
def test_soak_on_sim_keeps_the_probes_and_the_memory(server_build, tiny_model, tmp_path):
    s = run(_config(server_build, tiny_model, tmp_path, clients=4, seconds=20, pause_every=6, max_prompt=2000,
                    compare_all_gpu=True))
    assert s["ok"], json.dumps(s["checks"])
    assert s["cache_mib"] == 2 and s["cache"]["banks_up_to"] == 1  # a quarter of the tiny model's 6.4 MiB
    req = s["requests"]
    assert req["errors"] == 0 and req["served"] >= 20 and req["generated_tokens"] > 0
    assert req["prompt_tokens_computed"] < req["prompt_tokens"]  # continued prompts reused their slot's cells
    # the changes that reserve the context again all happened
    assert req["lora_posts"] and req["per_request_lora"] and req["backend_sampling"] and req["reserves"] > 10
    assert [r["label"] for r in s["probe_rounds"]][-1] == "end" and len(s["probe_rounds"]) >= 3
    assert s["memory"]["flat"] is True and s["server"]["exit_code"] == 0
    rows = s["all_gpu"]["probes"]
    assert [r["guaranteed"] for r in rows] == [n != 24 for n, _ in PROBES]
    assert all(r["equal"] for r in rows if r["guaranteed"])
    log = (tmp_path / "server.log").read_text()
    assert "llama_adapter_lora_init_impl: loaded 16 tensors from lora file" in log
    assert (tmp_path / "summary.json").is_file() and "probe round" in (tmp_path / "soak.log").read_text()


@pytest.mark.build
def test_soak_fails_when_the_probes_change_between_rounds(server_build, tiny_model, tmp_path):
    s = run(_config(server_build, tiny_model, tmp_path, clients=2, seconds=2, max_prompt=200,
                    plant_probe_change=True))
    assert not s["ok"] and s["checks"]["probes_identical"] is False and s["checks"]["errors"]
    # the adapter's global scale reaches the probes that name none, not those with a scale of their own
    (last,) = s["probe_rounds"]
    changed = {int(d.split(":")[0].split()[1]) for d in last["differences"]}
    assert changed == {i for i, (_, extra) in enumerate(PROBES) if "lora" not in extra}
