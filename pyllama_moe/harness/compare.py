"""`pyllama-moe compare`: run the identity matrix, baseline build against candidate build, cell by cell.

A cell passes when what it computed (logits, perplexity, text, and the checks that the candidate really took its
pinned, prefetch and cache paths) matches its `expect`; a divergence cell is held to the divergence contract
instead (divergence.py). A CUDA cell without a GPU is deferred, never passed, and a run where no cell passed fails.
The checks and outcomes: docs/identity.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pyllama_moe.bench.limits import uploading_ubatches
from pyllama_moe.build.builder import Build, resolve
from pyllama_moe.errors import UserError
from pyllama_moe.harness import divergence, models, runner
from pyllama_moe.harness.matrix import DIVERGENCE_EXPECTS, SIM_DEVICES, Cell, Matrix
from pyllama_moe.progress import say
from pyllama_moe.source import sdist as source
from pyllama_moe.source.sdist import Source
from pyllama_moe.worker.fault import parse_fault


@dataclass
class Check:
    name: str
    identical: bool
    detail: dict = field(default_factory=dict)


@dataclass
class CellResult:
    cell: Cell
    status: str  # pass | fail | deferred
    checks: list[Check] = field(default_factory=list)
    note: str = ""
    seconds: float = 0.0
    # a by-path cell: the reference the candidate's decode paths named, and those paths (choose_reference)
    reference: dict = field(default_factory=dict)


def logit_diagnostics(base: np.ndarray, cand: np.ndarray) -> dict:
    if base.shape != cand.shape:
        return {"shape_base": list(base.shape), "shape_candidate": list(cand.shape)}
    rows_differ = np.flatnonzero(np.any(base.view(np.uint32) != cand.view(np.uint32), axis=1))
    kld = divergence.position_kl(base, cand)
    return {
        "first_diff_pos": int(rows_differ[0]) if rows_differ.size else None,
        "positions_differing": int(rows_differ.size),
        "values_differing": float(np.mean(base != cand)),
        "max_abs": float(np.max(np.abs(base.astype(np.float64) - cand.astype(np.float64)))),
        "mean_kld": float(kld.mean()),
        "max_kld": float(kld.max()),
        "top1_agreement": float(divergence.top1_match(base, cand).mean()),
    }


def _perplexity_args(cell: Cell, model: Path, corpus: Path, repack: bool, threads: int, place: dict) -> list[str]:
    args = ["-m", str(model), "-f", str(corpus), "-c", str(cell.ppl_ctx), "-b", str(cell.ppl_ctx),
            "-ub", str(min(cell.ubatch, cell.ppl_ctx)), "--chunks", str(PPL_CHUNKS), "-t", str(threads),
            "--fit", cell.fit, "-lm", cell.load, "--no-warmup"]
    args += ["-ngl", str(place.get("n_gpu_layers", 99))]
    if place.get("cpu_moe"):
        args.append("-cmoe")
    if place.get("n_cpu_moe"):
        args += ["-ncmoe", str(place["n_cpu_moe"])]
    if place.get("cpu_moe_layers"):
        args += ["-ot", ot_rule(place["cpu_moe_layers"])]
    if not repack:
        args.append("-nr")
    return args


def _run_perplexity(build: Build, args: list[str], env: dict) -> str:
    exe = build.tool("llama-perplexity")
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, env=env)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-10:])
        raise UserError(f"llama-perplexity of the {build.variant} build failed (exit {proc.returncode}):\n{tail}",
                        "see the log lines above")
    return out


def _ppl_values(out: str) -> dict:
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
    chunks = re.findall(r"\[(\d+)\]([0-9.]+|nan|inf)", out)
    return {"final": final.group(1) if final else None, "chunks": [v for _, v in chunks]}


def _kld_summary(out: str) -> dict:
    keys = {"mean_kld": r"Mean\s+KLD:\s+(\S+)", "max_kld": r"Maximum KLD:\s+(\S+)", "same_top_p": r"Same top p:\s+(\S+)",
            "ppl_q": r"Mean PPL\(Q\)\s+:\s+(\S+)", "ppl_base": r"Mean PPL\(base\)\s+:\s+(\S+)"}
    found = {k: re.search(p, out) for k, p in keys.items()}
    return {k: m.group(1) for k, m in found.items() if m}


class Harness:
    def __init__(self, matrix: Matrix, src: Source, builds: dict[tuple[str, str], Build], threads: int):
        self.matrix, self.src, self.builds, self.threads = matrix, src, builds, threads

    def run_cell(self, cell: Cell) -> CellResult:
        started = time.monotonic()
        if cell.backend == "cuda" and not shutil.which("nvidia-smi"):
            return CellResult(cell, "deferred", note="needs a CUDA GPU; none on this machine")
        base_build = self.builds[(cell.baseline, cell.build_backend)]
        cand_build = self.builds[(cell.candidate, cell.build_backend)]
        # a split model is cut by the baseline build's llama-gguf-split (the shards do not depend on the build)
        model = models.ensure_model(cell.model, self.matrix.models[cell.model], base_build)
        corpus = models.ensure_corpus(model, tokens=max(4000, 2 * cell.ppl_ctx + 500))
        prompt = corpus.read_text()
        env = dict(self.matrix.knobs[cell.knobs])
        oplog = None
        if cell.backend in SIM_DEVICES:
            # the op log proves the candidate really ran on the simulated devices: without it a build lacking
            # the sim backend would compute on the CPU and pass for the wrong reason
            oplog = Path(tempfile.mkdtemp(prefix="pyllama-moe-sim-")) / "oplog.jsonl"
            env.update(self.matrix.sim_env, GGML_SIM_DEVICES=str(SIM_DEVICES[cell.backend]))
        common = dict(model=model, prompt=prompt, n_ubatch=cell.ubatch, n_batch=cell_n_batch(cell),
                      load_mode=cell.load, threads=self.threads, generate=cell.generate,
                      max_prompt_tokens=cell.prompt_tokens, eval_callback=cell.eval_callback, parallel=cell.parallel)
        cand_env = {**env, "GGML_SIM_OPLOG": str(oplog)} if oplog else env
        if cell.expect in DIVERGENCE_EXPECTS:
            return self._divergence_cell(cell, started, base_build, cand_build, common, cand_env, oplog)
        # mode 1 (the default) prefetches on CUDA-family devices only, mode 2 on sim devices too
        mode = env.get("GGML_SCHED_PREFETCH", "1")
        prefetch_on = cell.candidate == "patched" and (mode == "2" or (mode == "1" and cell.backend == "cuda"))
        by_path = cell.baseline_offload == "by-path"
        cache_on = (cell.candidate == "patched" and cell.backend != "cpu"
                    and int(env.get("LLAMA_MOE_CACHE_MIB", "0")) > 0)
        want_paths = cache_on and (by_path or cell.parallel > 1)

        def run_candidate():
            return runner.run(cand_build, self.src, runner.RunSpec(repack=cell.candidate_repack, env=cand_env,
                                                                   stats=prefetch_on or want_paths or by_path,
                                                                   **common, **cell.placement()))

        def run_baseline(place: dict):
            return runner.run(base_build, self.src, runner.RunSpec(repack=cell.baseline_repack, **common, **place))

        reference = {}
        if by_path:
            # the reference is known only once the candidate has said which cached layers left the banks
            cand = run_candidate()
            paths = decode_paths(cand.stats)
            experts, _ = expert_layers(model)
            try:
                reference = choose_reference(paths, host_layers(cell, experts), experts, cell.backend)
            except UserError as exc:
                if oplog is not None:
                    shutil.rmtree(oplog.parent, ignore_errors=True)
                return CellResult(cell, "fail", note=str(exc), seconds=time.monotonic() - started,
                                  reference={"paths": {str(il): steps for il, steps in sorted(paths.items())}})
            base_place = reference.pop("placement")
            base = run_baseline(base_place)
        else:
            base_place = cell.placement(baseline=True)
            base = run_baseline(base_place)
            cand = run_candidate()
        checks = []
        if cell.candidate == "patched" and cell.backend != "cpu" and cell.load == "mmap" and cell.offload != "all":
            checks.append(pin_check(cand.log, budget_mib=_float_or_none(env.get("LLAMA_MOE_PIN_BUDGET_MIB"))))
        if prefetch_on and cell.backend != "cpu" and cell.offload != "all":
            checks.append(prefetch_check(cell, env, cand.stats, cand.log))
        if cache_on:
            prefetch = env.get("GGML_SCHED_PREFETCH", "1")
            ahead = ubatches_ahead(cell, env) if prefetch == "2" or (prefetch == "1" and cell.backend == "cuda") else 0
            # a SIM device without the lookup ops keeps the host-side plan for its group: neither path everywhere
            want_device = None if env.get("GGML_SIM_NO_CACHE_OPS") else env.get("LLAMA_MOE_CACHE_DEVICE", "1") != "0"
            # parallel steps whose experts may not fit the slots leave the banks in every layer: no decode read them
            reads = not want_paths or any(steps[p] for steps in decode_paths(cand.stats).values() for p in READ_PATHS)
            checks.append(cache_check(cand.log, ahead, want_device=want_device, decode_reads=reads,
                                      probe=int(env.get("LLAMA_MOE_CACHE_PROBE", "0"))))
        if want_paths:
            _, k = expert_layers(model)
            checks.append(paths_check(decode_paths(cand.stats), cand.log, cell.parallel, k, max(cell.generate - 1, 0),
                                      decode_max=int(env.get("LLAMA_MOE_CACHE_DECODE_MAX", "8"))))
        if oplog is not None:
            races = sim_races_check(oplog)
            if races is None:
                return CellResult(cell, "fail", note=EMPTY_OPLOG, seconds=time.monotonic() - started)
            checks.append(races)
        same = base.logits_sha256 == cand.logits_sha256
        detail = {"sha256_base": base.logits_sha256, "sha256_candidate": cand.logits_sha256,
                  "positions": int(base.logits.shape[0])}
        if cell.candidate == "patched":
            # which order computed the candidate's prompt: a CUDA pass proves layer-major calls only where this is > 0
            detail["layer_major_calls"] = len(LAYER_MAJOR_CALL.findall(cand.log))
            if cell.knobs.startswith("layer-major"):
                # the cells that cut the layers into groups must have run the prompt group by group
                checks.append(Check("layer-major", detail["layer_major_calls"] > 0,
                                    {"calls": detail["layer_major_calls"]}))
        if not same:
            detail.update(logit_diagnostics(base.logits, cand.logits))
        checks.append(Check("logits", same, detail))
        same_text = base.generated == cand.generated
        text_detail = {"tokens": len(base.generated)}
        if not same_text:
            first = next((i for i, (a, b) in enumerate(zip(base.generated, cand.generated)) if a != b),
                         min(len(base.generated), len(cand.generated)))
            text_detail.update(first_diff_token=first, base=base.text[:80], candidate=cand.text[:80])
        checks.append(Check("text", same_text, text_detail))
        if base.decode_logits_sha256 and cand.decode_logits_sha256:
            # the text can be equal while a logit is not: every decode step's logits (every sequence's), byte for byte
            checks.append(Check("decode-logits", base.decode_logits_sha256 == cand.decode_logits_sha256,
                                {"sha256_base": base.decode_logits_sha256, "sha256_candidate": cand.decode_logits_sha256,
                                 "steps": max(cell.generate - 1, 0), "sequences": cell.parallel}))
        if cell.perplexity:
            checks.append(self._perplexity(cell, model, corpus, base_build, cand_build, env, base_place))
        if cell.expect == "identical":
            ok = all(c.identical for c in checks)
        else:  # a negative control: what it computed (the logits, or the generated text) must be reported as different
            ok = not all(c.identical for c in checks if c.name in ("logits", "decode-logits", "text", "perplexity"))
        return CellResult(cell, "pass" if ok else "fail", checks, seconds=time.monotonic() - started,
                          reference=reference)

    def _divergence_cell(self, cell: Cell, started: float, base_build: Build, cand_build: Build, common: dict,
                         cand_env: dict, oplog: Path | None) -> CellResult:
        """Three runs over the same tokens: the reference (master as the cell's baseline places it) generates greedily;
        the candidate (with the cell's fault, if any) and the yardstick are teacher-forced its tokens. Then the
        divergence contract (divergence.py) on the prompt's logits, every decode step's and the perplexity chunks'."""
        chunks = (cell.ppl_ctx, PPL_CHUNKS) if cell.perplexity else None
        fault = parse_fault(cell.fault) if cell.fault else None

        def side(build: Build, place: dict, repack: bool, env: dict, forced=None, planted=None) -> runner.RunResult:
            return runner.run(build, self.src, runner.RunSpec(repack=repack, env=env, want_decode_logits=True,
                                                              ppl_chunks=chunks, forced_tokens=forced, fault=planted,
                                                              **common, **place))

        ref = side(base_build, cell.placement(baseline=True), cell.baseline_repack, {})
        cand = side(cand_build, cell.placement(), cell.candidate_repack, cand_env, ref.generated, fault)
        yard = side(base_build, cell.yardstick_placement(), cell.baseline_repack, {}, ref.generated)
        seconds = time.monotonic() - started
        checks = []
        if oplog is not None:
            races = sim_races_check(oplog)
            if races is None:
                return CellResult(cell, "fail", note=EMPTY_OPLOG, seconds=seconds)
            checks.append(races)
        if fault and not cand.fault_rows_scaled:
            return CellResult(cell, "fail", checks, seconds=seconds,
                              note=f"the fault {cell.fault} never landed: layer {fault['layer']} never routed a token "
                                   f"to expert {fault['expert']}")
        detail = {"positions": divergence_positions(ref, bool(chunks)),
                  **divergence.contract(*(divergence_segments(r) for r in (ref, cand, yard)))}
        if fault:
            detail["fault"] = {**fault, "rows_scaled": cand.fault_rows_scaled}
        checks.append(Check("divergence", detail["holds"], detail))
        ok = all(c.identical for c in checks if c.name != "divergence")
        ok = ok and detail["holds"] == (cell.expect == "divergence")
        return CellResult(cell, "pass" if ok else "fail", checks, seconds=seconds)

    def _perplexity(self, cell, model, corpus, base_build, cand_build, env, base_place) -> Check:
        """Both builds write llama-perplexity's saved log-probs (`--kl-divergence-base`); identical files mean
        identical perplexity inputs. The printed values are kept as information only: the tools' logger is
        asynchronous and leaked at exit, so under load its last lines are sometimes never printed."""
        run_env = dict(os.environ)
        with tempfile.TemporaryDirectory(prefix="pyllama-moe-ppl-") as tmp:
            base_file, cand_file = str(Path(tmp) / "base.kld"), str(Path(tmp) / "candidate.kld")
            base_args = _perplexity_args(cell, model, corpus, cell.baseline_repack, self.threads, base_place)
            cand_args = _perplexity_args(cell, model, corpus, cell.candidate_repack, self.threads, cell.placement())
            base_out = _run_perplexity(base_build, base_args + ["--kl-divergence-base", base_file], run_env)
            cand_out = _run_perplexity(cand_build, cand_args + ["--kl-divergence-base", cand_file], {**run_env, **env})
            digests = []
            for path, build in ((base_file, base_build), (cand_file, cand_build)):
                if not Path(path).is_file() or Path(path).stat().st_size == 0:
                    raise UserError(f"llama-perplexity of the {build.variant} build wrote no log-probs for {cell.label}",
                                    "run it by hand to see why")
                digests.append(source.sha256_file(Path(path)))
            same = digests[0] == digests[1]
            detail = {"logprobs_sha256_base": digests[0], "logprobs_sha256_candidate": digests[1],
                      "ppl_base": _ppl_values(base_out)["final"], "ppl_candidate": _ppl_values(cand_out)["final"]}
            if not same:
                out = _run_perplexity(cand_build, cand_args + ["--kl-divergence-base", base_file, "--kl-divergence"],
                                      {**run_env, **env})
                detail.update(_kld_summary(out))
        return Check("perplexity", same, detail)


EMPTY_OPLOG = "the candidate did not run on the sim device (empty op log)"
PPL_CHUNKS = 2  # llama-perplexity's --chunks in the perplexity check; the divergence cells evaluate as many


def sim_races_check(oplog: Path) -> Check | None:
    """The sim-races check from a candidate's op log, which it then removes; None where the log is empty (the
    candidate never ran on a sim device, and would pass for the wrong reason)."""
    used, races = read_sim_oplog(oplog)
    shutil.rmtree(oplog.parent, ignore_errors=True)
    if not used:
        return None
    # a race is a read of memory a queued stream operation still wrote: a missing wait, even where the bytes happened
    # to come out right
    return Check("sim-races", races == 0, {"races": races, "devices": sorted(used)})


def divergence_segments(run: runner.RunResult) -> list[np.ndarray]:
    """A run's logits as the divergence contract's segments: the prompt's, the decode steps', and each perplexity
    chunk's scored rows (the runs evaluate PPL_CHUNKS chunks of equal length)."""
    segments = [run.logits, run.decode_logits]
    if run.ppl_logits is not None:
        segments += np.split(run.ppl_logits, PPL_CHUNKS)
    return segments


def divergence_positions(run: runner.RunResult, with_chunks: bool) -> dict[str, int]:
    """How many positions each kind of segment gave the contract (the chunks summed)."""
    out = {"prompt": len(run.logits), "decode": len(run.decode_logits)}
    if with_chunks:
        out["perplexity"] = len(run.ppl_logits)
    return out


def prefetch_check(cell: Cell, env: dict[str, str], stats: dict | None, log: str = "") -> Check:
    """The prefetch really took its path: prompt ubatches of at least min_batch tokens uploaded host weights
    ahead; a context whose ubatches are all smaller has no staging arena at all (nothing would be uploaded ahead
    into it), and one with larger ubatches but a shorter prompt has the arena and uploads nothing ahead. An expert
    cache that filled every cached layer whole when it was made (by the candidate's log) leaves no host weight for a
    GPU split to read in the cells' placements (only experts are on the host, all of them cached and read in place):
    no arena, nothing uploaded; but not with LLAMA_MOE_CACHE_PROBE=2, which reads no layer in place."""
    prompt = (stats or {}).get("prompt", {})
    min_batch = prefetch_min_batch(env)
    cached = prompt.get("cache_layers", 0)
    all_in_place = cached > 0 and filled_whole_layers(log) == cached and env.get("LLAMA_MOE_CACHE_PROBE", "0") != "2"
    staging = cell.ubatch >= min_batch and not all_in_place
    ahead = staging and cell.prompt_tokens >= min_batch
    # below the min batch only the test setting LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS makes a prompt layer-major, and
    # its groups after the first upload ahead, into the groups' own regions rather than the ring's arena
    ahead = ahead or (cell.ubatch < min_batch < cell.prompt_tokens
                      and int(env.get("LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS", "0")) > 0)
    uploads, arena = prompt.get("n_prefetch_uploads", 0), prompt.get("prefetch_arena_bytes", 0)
    # the expert cache writes the staged copies of its layers' experts itself, uploads the scheduler leaves out: the
    # misses from the host, the residents from the banks
    cache_prompt = prompt.get("cache_prompt", {})
    uploads += cache_prompt.get("n_misses", 0) + cache_prompt.get("n_hits", 0)
    ok = (arena > 0) == staging and (uploads > 0) == ahead
    return Check("prefetch", ok, {"expect_staging": staging, "expect_uploads_ahead": ahead, "all_in_place": all_in_place,
                                  **prompt})


def prefetch_min_batch(env: dict[str, str]) -> int:
    """The smallest ubatch that uploads host weights ahead: GGML_SCHED_PREFETCH_MIN_BATCH, else the scheduler's
    default (128)."""
    return int(env.get("GGML_SCHED_PREFETCH_MIN_BATCH", "128"))


def cell_n_batch(cell: Cell) -> int:
    """The batch a cell's runs decode at a time: 2048 tokens, or the ubatch where that is larger."""
    return max(cell.ubatch, 2048)


def ubatches_ahead(cell: Cell, env: dict[str, str]) -> int:
    """The prompt ubatches of a cell that upload host weights ahead: those of at least min_batch tokens."""
    return uploading_ubatches(cell.prompt_tokens, cell_n_batch(cell), cell.ubatch, min_tokens=prefetch_min_batch(env))


PINNED_IN_PLACE = re.compile(r"llama_moe: ([0-9.]+ [MG]iB) of expert weights registered with (\S+) "
                             r"\(page-locked in place: (\d+) range\(s\), ([0-9.]+ [MG]iB)\)")
# a pin budget below the experts (the pin-budget knob): part of the ranges registered and the rest left pageable,
# or, where even the first range is larger than the budget, none; either way the line names the budget
PINNED_IN_PART = re.compile(r"llama_moe: (?:([0-9.]+ [MG]iB) of [0-9.]+ [MG]iB of expert ranges registered with (\S+) "
                            r"\(page-locked in place: (\d+) range\(s\)\); the rest stays pageable|"
                            r"[0-9.]+ [MG]iB of expert weights left pageable: not one range of them fits)"
                            r".* the budget of LLAMA_MOE_PIN_BUDGET_MIB")


def _mib(size: str) -> float:
    """llama_moe's "3.41 MiB" / "1.25 GiB" in MiB."""
    value, unit = size.split()
    return float(value) * (1024 if unit == "GiB" else 1)


def _float_or_none(text: str | None) -> float | None:
    return float(text) if text is not None else None


def pin_check(log: str, budget_mib: float | None = None) -> Check:
    """Every host expert the device uploads from the mapped file was page-locked in place: the line that says so, and
    no other. Under a pin budget (budget_mib), no more than the budget is page-locked. The cases and why:
    docs/identity.md, "What a cell compares"."""
    lines = [line[line.index("llama_moe: "):] for line in log.splitlines()
             if "llama_moe: " in line and "expert cache" not in line  # the cache's lines are cache_check's
             and "layer-major" not in line]  # layer-major prompts' plan and calls (docs/layer-major.md)
    line = lines[0] if len(lines) == 1 else ""
    m = PINNED_IN_PLACE.search(line)
    if budget_mib is not None and not (m and _mib(m.group(4)) <= budget_mib):
        m = PINNED_IN_PART.search(line)
    detail = {"log": lines[:3]}
    if m and m.group(1):
        detail.update(expert_bytes=m.group(1), device=m.group(2), ranges=int(m.group(3)))
    return Check("pinned", m is not None, detail)


CACHE_MADE = re.compile(r"llama_moe: expert cache on (\S+): ([0-9.]+) MiB, (\d+) MoE layers with their experts on the "
                        r"host, (\d+)-(\d+) of (\d+) expert slots")
CACHE_DECODE = re.compile(r"llama_moe: expert cache, decode: (\d+) layer steps, (\d+) hits, (\d+) misses.*, (\d+) read in place")
CACHE_DEVICE = re.compile(r"llama_moe: expert cache on (\S+): decode looks up its slots and fills its misses on the device")
# a device whose cached layers decode hot/cold: its miss policy and the largest such graph
CACHE_HOT_COLD = re.compile(r"llama_moe: expert cache on (\S+): miss policy (\S+); decode graphs of up to (\d+) tokens "
                            r"compute the misses")
CACHE_HOST = re.compile(r"llama_moe: expert cache on (\S+): decode plans (\d+) of (\d+) layers on the host")
CACHE_FILLED_WHOLE = re.compile(r"llama_moe: expert cache: (\d+) layers? with a slot per expert filled whole")
CACHE_PROMPT = re.compile(r"llama_moe: expert cache, prompts: (\d+) layer steps, (\d+) experts read from the banks, "
                          r"(\d+) uploaded \([0-9.]+ MiB\), (\d+) made resident.*, (\d+) read in place")


def filled_whole_layers(log: str) -> int:
    """The layers a context's expert cache filled whole when it was made (one line for all of its devices), by its
    log; 0 where it filled none."""
    m = CACHE_FILLED_WHOLE.search(log)
    return int(m.group(1)) if m else 0


# a decode call computed layer group by layer group (docs/layer-major.md)
LAYER_MAJOR_CALL = re.compile(r"llama_moe: layer-major prompt: \d+ tokens in")


def cache_check(log: str, ubatches_ahead: int = 0, want_device: bool | None = None, decode_reads: bool = True,
                probe: int = 0) -> Check:
    """The expert cache really took its path, by the context's summary at its end (banks made on which devices, with
    how many slots per layer): what a partial and a whole cache must show is in docs/identity.md, "The cache check".

    want_device: decode looks its slots up on every device (True: the default where the backend has the lookup ops),
    or plans on the host there (False: LLAMA_MOE_CACHE_DEVICE=0); None: either. decode_reads False: no decode step read
    the banks (parallel steps whose experts may not fit the slots), so none planned or missed. probe: the cache's
    LLAMA_MOE_CACHE_PROBE; with 2 a whole cache is never read in place: every decode step looks up and hits."""
    made = [m.groups() for m in CACHE_MADE.finditer(log)]
    decode = [tuple(map(int, m.groups())) for m in CACHE_DECODE.finditer(log)]
    prompt = [tuple(map(int, m.groups())) for m in CACHE_PROMPT.finditer(log)]
    steps = sum(d[0] for d in decode)
    misses = sum(d[2] for d in decode)
    in_place = sum(d[3] for d in decode) + sum(p[4] for p in prompt)
    p_steps, p_reads, p_fills = (sum(p[i] for p in prompt) for i in (0, 1, 3))
    layer_major_calls = len(LAYER_MAJOR_CALL.findall(log))
    whole = bool(made) and all(int(m[3]) == int(m[5]) for m in made)
    filled_whole = filled_whole_layers(log)
    some_whole = any(int(m[4]) == int(m[5]) for m in made)
    on_device = {m.group(1) for m in CACHE_DEVICE.finditer(log)}
    on_host = {m.group(1) for m in CACHE_HOST.finditer(log)}
    devices = [m[0] for m in made]
    decode_path = "device" if devices and on_device >= set(devices) else "host" if devices and on_host >= set(devices) \
        else "mixed"
    detail = {"devices": devices, "decode_path": decode_path, "whole": whole, "filled_whole": filled_whole,
              "layer_steps": steps,
              "hits": sum(d[1] for d in decode),
              "misses": misses, "in_place": in_place, "prompt_ubatches_ahead": ubatches_ahead,
              "prompt_layer_steps": p_steps, "prompt_reads": p_reads, "prompt_fills": p_fills,
              "layer_major_calls": layer_major_calls}
    detail["probe"] = probe
    if whole and filled_whole and probe == 2:
        ok = in_place == 0 and p_fills == 0 and steps > 0 and misses == 0 and detail["hits"] > 0
    elif whole and filled_whole:
        ok = in_place > 0 and p_fills == 0
    elif whole:
        ok = in_place > 0 and (ubatches_ahead == 0 or p_fills > 0)
    else:
        # in ubatch order each later ubatch reads the residents the first admitted; a layer-major call writes each
        # layer's copies once, in its first ubatch, when a fresh cache holds nothing to read (docs/layer-major.md)
        reads_ok = layer_major_calls > 0 or (p_reads > 0) == (ubatches_ahead > 1)
        prompt_ok = (p_steps > 0) == (ubatches_ahead > 0) and (ubatches_ahead == 0 or p_fills > 0) and reads_ok
        ok = (not decode_reads or (steps > 0 and misses > 0)) and (in_place == 0 or some_whole) and prompt_ok
    if want_device is not None:
        ok = ok and decode_path == ("device" if want_device else "host")
    return Check("cache", bool(made) and ok, detail)


# the paths of llama_moe_cache_get_path_steps that read a cached layer's banks, and those that leave them for the host
# weights (docs/cache-paths.md): the bytes of the first equal all on the GPU's, of the second master --cpu-moe's
READ_PATHS = ("in_place", "device", "host_plan")
LEAVE_PATHS = ("staging", "host")
# hot/cold: each routed expert on the kernel of where it was computed, the banks' on the GPU, the cold ones on the
# CPU; on SIM (the CPU's kernels everywhere) those are master --cpu-moe's bytes, elsewhere no build computes them
MIXED_PATHS = ("hot_cold",)
EXPS_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps\.")


def decode_paths(stats: dict | None) -> dict[int, dict[str, int]]:
    """The generation's steps per cached layer and path, from a run's stats (the worker's "decode_paths")."""
    return {int(il): steps for il, steps in ((stats or {}).get("decode_paths") or {}).items()}


def expert_layers(model: Path) -> tuple[set[int], int]:
    """The layers of a GGUF with expert tensors (over every shard of a split model), and the experts a token routes
    to."""
    from pyllama_moe.synth.gguf_read import read_gguf

    info = read_gguf(model, check_data=False)
    shards = [model]
    m = re.match(r"(.*)-(\d{5})-of-(\d{5})\.gguf$", Path(model).name)
    if m:
        n = int(m.group(3))
        shards = [Path(model).with_name(models.shard_name(m.group(1), i, n)) for i in range(1, n + 1)]
    layers = set()
    for shard in shards:
        names = info.tensors if shard == model else read_gguf(shard, check_data=False).tensors
        layers |= {int(t.group(1)) for t in map(EXPS_TENSOR.match, names) if t}
    return layers, int(info.arch_key("expert_used_count", 0))


def host_layers(cell: Cell, experts: set[int]) -> set[int]:
    """The layers whose experts the candidate's placement keeps on the host (the matrix allows by-path with these)."""
    if cell.offload == "cpu-moe":
        return set(experts)
    return {il for il in experts if il < int(cell.offload.partition("-")[2])}


def ot_rule(layers) -> str:
    """The -ot rule that keeps exactly these layers' expert tensors on the CPU (worker/model.py's "cpu_moe_layers")."""
    from pyllama_moe.worker.model import EXPS_REGEX

    return rf"blk\.({'|'.join(str(il) for il in sorted(layers))}){EXPS_REGEX}=CPU"


def choose_reference(paths: dict[int, dict[str, int]], host: set[int], experts: set[int], backend: str = "cpu") -> dict:
    """The run whose bytes a by-path cell's decode must equal, from the candidate's decode steps per cached layer and
    path: the host experts that read the banks computed as on the GPU, the others (those that left them, and any
    without slots) on the CPU. Every one on the GPU: master with every weight there ("all"); none: master --cpu-moe
    (where the host held every layer's experts); else master with an -ot rule for those left on the CPU. Returns
    "reference", "cpu_layers", "ot", "paths" (each layer's path) and "placement" (RunSpec fields). A layer that read
    the banks in some steps and left them in others has no one reference: a UserError that names it."""
    if not paths:
        raise UserError("no cached layer counted a decode step: the cell's paths name no reference",
                        "give the cell a cache (LLAMA_MOE_CACHE_MIB) and generate at least 2 tokens")
    for il, steps in sorted(paths.items()):
        if backend == "cuda" and any(steps.get(p) for p in MIXED_PATHS):
            raise UserError(f"cached layer {il} was computed hot/cold on {backend}: its experts mix GPU and CPU kernels, "
                            "so no master run computes its bytes",
                            "check such cells with the divergence contract (docs/identity.md)")
        if any(steps.get(p) for p in READ_PATHS) and any(steps.get(p) for p in LEAVE_PATHS + MIXED_PATHS):
            taken = ", ".join(f"{p} {n}" for p, n in steps.items() if n)
            raise UserError(f"cached layer {il} read the banks in some decode steps and left them in others ({taken}): "
                            "no one reference computes its bytes",
                            "a graph of a given size takes one path per layer (docs/cache-paths.md): "
                            "find what changed it")
    reading = {il for il, steps in paths.items() if any(steps.get(p) for p in READ_PATHS)}
    cpu = sorted(set(host) - reading)
    if not cpu:
        ref, place = "all", {}
    elif set(cpu) == set(experts):
        ref, place = "cpu-moe", {"cpu_moe": True}
    else:
        ref, place = "-ot", {"cpu_moe_layers": cpu}
    return {"reference": ref, "cpu_layers": cpu, "ot": ot_rule(cpu) if ref == "-ot" else "",
            "paths": {str(il): "+".join(p for p, n in steps.items() if n) for il, steps in sorted(paths.items())},
            "placement": place}


def predicted_paths(log: str, n_tokens: int, k: int, decode_max: int = 8) -> dict[str, tuple[int, int]]:
    """How many cached layers a graph of n_tokens sends down each path, by the cache's lines in a log (slots per
    layer, per device) and docs/cache-paths.md's table: path -> (fewest, most). A device whose layers' slots differ
    (the line's "7-8 of 16") has at least one layer at each end; where the two ends take different paths, each takes
    1 to n - 1 of its n layers."""
    on_device = {m.group(1) for m in CACHE_DEVICE.finditer(log)}
    hot_cold = {m.group(1): (m.group(2), int(m.group(3))) for m in CACHE_HOT_COLD.finditer(log)}
    whole_filled = filled_whole_layers(log) > 0

    def path(slots: int, n_expert: int, dev: str) -> str:
        if slots == n_expert and whole_filled:
            return "in_place"
        fits = n_tokens <= decode_max and n_tokens * k <= slots
        policy, hot_cold_max = hot_cold.get(dev, ("upload", 0))
        if fits and policy == "upload":
            return "device" if dev in on_device else "host_plan"
        if n_tokens <= hot_cold_max:
            return "hot_cold"
        if n_tokens > decode_max:
            return "host"
        if not fits:
            return "staging"
        return "device" if dev in on_device else "host_plan"

    out: dict[str, list[int]] = {}
    for m in CACHE_MADE.finditer(log):
        dev, n, smin, smax, n_expert = m.group(1), *map(int, m.groups()[2:])
        ends = {path(smin, n_expert, dev), path(smax, n_expert, dev)}
        for p in ends:
            lo, hi = out.setdefault(p, [0, 0])
            out[p] = [lo + (n if len(ends) == 1 else 1), hi + (n if len(ends) == 1 else n - 1)]
    return {p: (lo, hi) for p, (lo, hi) in out.items()}


def paths_check(paths: dict[int, dict[str, int]], log: str, n_tokens: int, k: int, n_steps: int,
                decode_max: int = 8) -> Check:
    """Each cached layer took one path in all n_steps decode steps (graphs of n_tokens), and as many layers took each
    path as the cache's slots predict (predicted_paths)."""
    taken = {il: [p for p, n in steps.items() if n] for il, steps in paths.items()}
    one_path = bool(paths) and all(len(t) == 1 and paths[il][t[0]] == n_steps for il, t in taken.items())
    counts: dict[str, int] = {}
    for t in taken.values():
        for p in t:
            counts[p] = counts.get(p, 0) + 1
    want = predicted_paths(log, n_tokens, k, decode_max)
    as_predicted = bool(want) and set(counts) <= set(want) and all(lo <= counts.get(p, 0) <= hi
                                                                   for p, (lo, hi) in want.items())
    return Check("cache-paths", one_path and as_predicted,
                 {"tokens": n_tokens, "steps": n_steps,
                  "paths": {str(il): steps for il, steps in sorted(paths.items())},
                  "layers_per_path": counts, "predicted": {p: list(r) for p, r in want.items()}})


def read_sim_oplog(oplog: Path) -> tuple[set, int]:
    """(devices that computed a graph, races reported) according to a sim op log."""
    used, races = set(), 0
    if oplog.is_file():
        for line in oplog.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("op") == "compute":
                used.add(entry.get("dev"))
            races += entry.get("op") == "race"
    return used, races


def needed_builds(cells: list[Cell]) -> set[tuple[str, str]]:
    return {(v, c.build_backend) for c in cells for v in (c.baseline, c.candidate)}


def resolve_builds(cells: list[Cell], make: bool, archive_dir: Path | None, **source_kw) -> dict[tuple[str, str], Build]:
    out = {}
    for variant, backend in sorted(needed_builds(cells)):
        if backend == "cuda" and not shutil.which("nvidia-smi"):
            continue
        archive = (archive_dir / f"llama.cpp-{variant}.tar.gz") if archive_dir else None
        out[(variant, backend)] = resolve(variant, backend, archive=archive, make=make, **source_kw)
    return out


def run_matrix(harness: Harness, cells: list[Cell], on_result=None) -> list[CellResult]:
    results = []
    for i, cell in enumerate(cells, 1):
        say(f"[{i}/{len(cells)}] {cell.label} ...")
        try:
            result = harness.run_cell(cell)
        except UserError as exc:
            result = CellResult(cell, "fail", note=str(exc))
        results.append(result)
        if on_result:
            on_result(result)
    return results


def summarize(results: list[CellResult]) -> tuple[int, dict]:
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "deferred")}
    rc = 0 if counts["fail"] == 0 and counts["pass"] > 0 else 1
    return rc, counts


def _mark(c: Check) -> str:
    if c.name == "divergence":
        return f"divergence={'within' if c.identical else 'FLAGGED'}"
    return f"{c.name}={'same' if c.identical else 'DIFF'}"


EXPECT_NOTES = {"identical": "", "divergence": "", "mismatch": " (expect mismatch)",
                "divergence-flagged": " (expect flagged)"}


def format_row(r: CellResult) -> str:
    marks = " ".join(map(_mark, r.checks)) or r.note
    extra = ""
    logits = next((c for c in r.checks if c.name == "logits"), None)
    if logits and not logits.identical:
        d = logits.detail
        extra = (f" first_diff_pos={d.get('first_diff_pos')} max_abs={d.get('max_abs', 0):.4g}"
                 f" kld={d.get('mean_kld', 0):.3g} top1={d.get('top1_agreement', 0):.3f}")
    div = next((c for c in r.checks if c.name == "divergence"), None)
    if div:
        extra = " " + divergence.summary_line(div.detail)
    expect = EXPECT_NOTES[r.cell.expect]
    if r.reference.get("reference"):
        extra += f" reference={r.reference['reference']}" + (f" ({r.reference['ot']})" if r.reference.get("ot") else "")
    return f"{r.status.upper():8} {r.cell.label:52} {marks}{extra}{expect} [{r.seconds:.1f}s]"


def to_json(results: list[CellResult], counts: dict) -> str:
    rows = []
    for r in results:
        rows.append({"cell": asdict(r.cell), "label": r.cell.label, "status": r.status, "note": r.note,
                     "seconds": round(r.seconds, 2), "checks": [asdict(c) for c in r.checks], "reference": r.reference})
    return json.dumps({"counts": counts, "cells": rows}, indent=1)
