"""`qkv bench`: the quick run produces consistent JSON and a plot; bad --plot paths exit 2 at once.

Timings are machine-dependent, so the checks are on what must hold on any machine: the
ratios are the ratios of the reported times, every case and size is present, the FLOP rate
follows from DESIGN.md's formula, qkv agrees with its peers, and memory was measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qkv.cli import app
from qkv.cli._bench_suite import QUICK
from qkv.dispatch import TILES


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    plot = tmp_path_factory.mktemp("bench") / "bench.png"
    result = CliRunner().invoke(app, ["bench", "--quick", "--json", "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), plot


def test_quick_json_holds_every_comparison(quick_run: tuple[dict, Path]) -> None:
    data, _ = quick_run
    names = [(c["name"], c["n"]) for c in data["comparisons"]]
    w = QUICK.window
    assert names == [
        (f"sliding_window({w}, {w}) forward", QUICK.n_window),
        (f"documents({QUICK.documents}) & causal forward", QUICK.n_docs),
        *[("causal forward", n) for n in QUICK.n_causal],
        (f"sliding_window({w}, {w}) forward + backward", QUICK.n_window),
    ]
    for c in data["comparisons"]:
        assert c["qkv_s"] > 0 and c["peer_s"] > 0
        assert c["speedup"] == pytest.approx(c["peer_s"] / c["qkv_s"])
        assert c["met"] is None  # a smoke run judges no goal
        if c["max_abs_err"] is not None:
            assert c["max_abs_err"] < 1e-4  # qkv and SDPA compute the same attention
    assert data["matmul_gflops"] > 0 and data["threads"] >= 1
    assert data["smoke_run"] is True


def test_quick_table_says_smoke_run_and_judges_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from qkv.cli import bench
    from qkv.cli._bench_suite import QUICK, STANDARD, BenchReport, Comparison

    slow = Comparison("causal forward", 512, qkv_s=2.0, peer="SDPA is_causal", peer_s=1.0, goal=0.95,
                      qkv_gflops=1.0, max_abs_err=0.0)
    for config, judged in ((QUICK, False), (STANDARD, True)):
        report = BenchReport(config=config, threads=2, torch_version="x", matmul_gflops=10.0,
                             comparisons=[slow], peak_rss_bytes=2**30)
        from qkv.cli._app import console

        with console.capture() as captured:
            bench.print_report(report)
        text = captured.get()
        assert ("MISSED" in text) == judged and (">= 0.95x" in text) == judged and ("(goal <" in text) == judged
        assert ("smoke run" in text) == (not judged)


def test_quick_flop_rate_follows_the_formula(quick_run: tuple[dict, Path]) -> None:
    data, _ = quick_run
    window = data["comparisons"][0]
    n, H, E, w = QUICK.n_window, QUICK.heads, QUICK.head_dim, QUICK.window
    # row groups [r0, r1) of the tile engine's block_q rows visit the keys r0 - w .. r1 - 1 + w in [0, n)
    bq = TILES.block_q
    groups = [(r0, min(n, r0 + bq)) for r0 in range(0, n, bq)]
    visited = sum((r1 - r0) * (min(n, r1 + w) - max(0, r0 - w)) for r0, r1 in groups)
    assert window["qkv_gflops"] == pytest.approx(4 * H * visited * E / window["qkv_s"] / 1e9)


def test_quick_sweep_and_memory(quick_run: tuple[dict, Path]) -> None:
    data, plot = quick_run
    sweep = data["sweep"]
    assert set(sweep) == {"qkv seconds", "SDPA dense mask seconds", "qkv peak RSS bytes", "SDPA dense mask peak RSS bytes"}
    for series in sweep.values():
        assert sorted(map(int, series)) == sorted(QUICK.sweep)
    # peak RSS never decreases along increasing sizes in one process, and it was measured
    assert data["peak_rss_bytes"] >= max(sweep["qkv peak RSS bytes"].values()) > 10 * 2**20
    assert plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(("path", "words"), [("bench.txt", ".png"), ("no/such/folder/bench.png", "does not exist")])
def test_bad_plot_path_exits_2_before_running(path: str, words: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "--quick", "--plot", str(tmp_path / path)])
    assert result.exit_code == 2
    assert words in result.output


def test_plot_path_that_is_a_folder_exits_2_before_running(tmp_path: Path) -> None:
    folder = tmp_path / "bench.png"
    folder.mkdir()
    result = CliRunner().invoke(app, ["bench", "--quick", "--plot", str(folder)])
    assert result.exit_code == 2
    assert "is a folder" in " ".join(result.output.split())  # rich wraps long lines


def test_a_failing_run_exits_1_with_a_message_not_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    import qkv.cli._bench_suite as suite

    def broken_suite(config: object):
        yield "warm-up and matmul rate", None
        raise RuntimeError("Compiler: cc is not found")

    monkeypatch.setattr(suite, "run_suite", broken_suite)
    result = CliRunner().invoke(app, ["bench", "--quick"])
    assert result.exit_code == 1
    message = " ".join(result.output.split())  # rich wraps long lines
    assert "failed after step 'warm-up and matmul rate'" in message and "cc is not found" in message
    assert "Traceback" not in result.output and not isinstance(result.exception, RuntimeError)


def test_other_dtypes_are_a_usage_error_before_any_work() -> None:
    result = CliRunner().invoke(app, ["bench", "--quick", "--dtype", "float16"])
    assert result.exit_code == 2
    assert "--dtype must be one of float32, bfloat16, got 'float16'" in result.output
    assert "Traceback" not in result.output


def test_the_suite_runs_in_the_dtype_it_is_given() -> None:
    import dataclasses

    import torch

    from qkv.cli._bench_suite import _inputs, _matmul_gflops

    config = dataclasses.replace(QUICK, dtype="bfloat16")
    q, k, v = _inputs(64, config, requires_grad=True)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.requires_grad and q.is_leaf
    assert _matmul_gflops(64, 1, "bfloat16") > 0
