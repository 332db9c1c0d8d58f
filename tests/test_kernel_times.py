"""Kernel durations from an Nsight Compute CSV (pyllama_moe/bench/kernel_times.py): units, names, skipped lines."""
from __future__ import annotations

import pytest

from pyllama_moe.bench.kernel_times import kernel_name, parse, table

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(i, kernel, unit, value, metric="gpu__time_duration.sum"):
    return (f'"{i}","7","llama-bench","h","{kernel}","1","13","(256, 1, 1)","(1, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


def test_durations_are_summed_per_kernel_in_microseconds():
    text = "\n".join([
        "==PROF== Connected to process 7",
        "main: loading model",
        HEADER,
        row(0, "moe_cache_lookup_kernel(const int *, int *, int *, int, int, int, long, long)", "usecond", "4.10"),
        row(1, "moe_cache_fill_kernel(const char *, long, long, char *, long, long, const int *, int, int)", "nsecond",
            "2,500"),
        row(2, "moe_cache_lookup_kernel(const int *, int *, int *, int, int, int, long, long)", "nsecond", "3900"),
        row(3, "mul_mat_vec_q<(ggml_type)2, 1>(const void *, const void *)", "msecond", "0.012"),
        row(4, "moe_cache_lookup_kernel(const int *)", "usecond", "99", metric="sm__cycles_elapsed.avg"),
    ])
    times = {k.name: k for k in parse(text)}
    assert set(times) == {"moe_cache_lookup_kernel", "moe_cache_fill_kernel", "mul_mat_vec_q<(ggml_type)2, 1>"}
    lookup = times["moe_cache_lookup_kernel"]
    assert lookup.launches == 2 and lookup.total_us == pytest.approx(8.0) and lookup.mean_us == pytest.approx(4.0)
    assert times["moe_cache_fill_kernel"].total_us == pytest.approx(2.5)
    assert times["mul_mat_vec_q<(ggml_type)2, 1>"].total_us == pytest.approx(12.0)
    # most time first; per token and per layer and token where given
    assert [k.name for k in parse(text)][0] == "mul_mat_vec_q<(ggml_type)2, 1>"
    md = table(parse(text), tokens=2, layers=2).splitlines()
    assert md[0].count("|") == md[1].count("|") == 7
    assert "| moe_cache_lookup_kernel | 2 | 4.00 | 8.0 | 4.00 | 2.00 |" in md


def test_unknown_units_and_empty_input():
    assert parse("no csv here\n") == []
    with pytest.raises(ValueError, match="unknown unit 'cycle'"):
        parse(HEADER + "\n" + row(0, "k()", "cycle", "3"))
    assert kernel_name("k<a(b)>(int)") == "k<a(b)>" and kernel_name("plain") == "plain"
