"""`qkv.bench.BenchReport`: it prints itself (goals judged or not) and finds a comparison by case."""

from __future__ import annotations

import dataclasses

import pytest
from rich.console import Console

from qkv.bench import QUICK, STANDARD, BenchReport, Comparison, steps


def _report(config, comparisons) -> BenchReport:
    return BenchReport(config=config, threads=2, torch_version="x", matmul_gflops=10.0,
                       comparisons=comparisons, peak_rss_bytes=2**30)


def _printed(report: BenchReport) -> str:
    console = Console(width=200, record=True)
    with console.capture() as captured:
        report.print(console)
    return captured.get()


SLOW = Comparison("causal", "causal forward", 512, qkv_s=2.0, peer="SDPA is_causal", peer_s=1.0, goal=0.95,
                  qkv_gflops=1.0, max_abs_err=0.0)


@pytest.mark.parametrize(("config", "judged"), [(QUICK, False), (STANDARD, True)])
def test_a_smoke_run_says_so_and_judges_nothing(config, judged: bool) -> None:
    text = _printed(_report(config, [SLOW]))
    assert ("MISSED" in text) == judged and (">= 0.95x" in text) == judged and ("(goal <" in text) == judged
    assert ("smoke run" in text) == (not judged)
    measured = "best of 1024^2, 2048^2" if config.matmul is None else f"{config.matmul}^2"
    assert f"{config.dtype} matmul on this machine ({measured}, same run): 10.0 GFLOP/s" in text
    assert "1.00 GiB" in text and "10%" in text  # peak RSS; 1 of 10 GFLOP/s


def test_the_window_line_is_found_by_case_not_by_its_display_name() -> None:
    window = Comparison("window", "any name at all", 1024, qkv_s=1.0, peer="a peer", peer_s=30.0, goal=20.0,
                        qkv_gflops=4.0, max_abs_err=0.0)
    report = _report(STANDARD, [SLOW, window])
    assert report.comparison("window") is window and report.comparison("window_flex") is None
    assert "sliding window forward: 4.0 GFLOP/s on visited tiles = 40% of the matmul rate" in _printed(report)
    renamed = dataclasses.replace(window, case="documents", name="sliding_window(1, 1) forward")
    assert "sliding window forward:" not in _printed(_report(STANDARD, [renamed]))


def test_json_judges_only_a_full_run() -> None:
    for config, met in ((QUICK, None), (STANDARD, False)):
        data = _report(config, [SLOW]).to_json()
        assert data["comparisons"][0]["met"] is met and data["comparisons"][0]["case"] == "causal"
        assert data["comparisons"][0]["speedup"] == 0.5 and data["smoke_run"] is (met is None)


def test_steps_counts_what_the_suite_yields() -> None:
    assert steps(QUICK) == 7  # no FlexAttention
    assert steps(STANDARD) == 8
    assert steps(dataclasses.replace(STANDARD, flex=False, backward=False)) == 6
