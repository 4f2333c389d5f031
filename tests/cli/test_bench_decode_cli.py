"""`qkv bench --decode --quick`: the decode table with the machine line, qkv on its decode path,
and a tiny generation run; timings are not judged (machine-dependent)."""

from __future__ import annotations

from typer.testing import CliRunner

from qkv.bench import decode_steps
from qkv.cli import app


def test_quick_decode_prints_both_tables() -> None:
    result = CliRunner().invoke(app, ["bench", "--decode", "--quick", "--generate", "16"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "decode step" in result.output and "tier" in result.output and "read bandwidth" in result.output
    assert "greedy generation" in result.output and "sdpa" in result.output


def test_rows_follow_from_their_times() -> None:
    (row,) = decode_steps((1024,), ("float32",), reps=1, probe_bytes=2**20)
    assert row.path == "decode" and row.kv_bytes == 2 * 8 * 1024 * 128 * 4
    assert row.ratio == row.sdpa_seconds / row.qkv_seconds and row.qkv_rate == row.kv_bytes / row.qkv_seconds


def test_bench_decode_names_the_decode_benchmark(monkeypatch) -> None:
    import qkv.cli.bench as bench_cli

    calls: list[tuple[bool, int]] = []
    monkeypatch.setattr(bench_cli, "_decode", lambda quick, prompt: calls.append((quick, prompt)))
    result = CliRunner().invoke(app, ["bench", "decode", "--quick", "--generate", "8"])
    assert result.exit_code == 0, result.output
    assert calls == [(True, 8)]


def test_bench_refuses_an_unknown_benchmark_and_a_stray_generate() -> None:
    unknown = CliRunner().invoke(app, ["bench", "decoding"])
    assert unknown.exit_code == 2 and "unknown benchmark 'decoding'" in unknown.output and "decode" in unknown.output
    stray = CliRunner().invoke(app, ["bench", "--generate", "8"])
    assert stray.exit_code == 2 and "--generate goes with the decode benchmark" in stray.output
    assert "Traceback" not in unknown.output + stray.output


def test_generation_runs_each_cache_for_both_implementations_and_refuses_others() -> None:
    import pytest

    from qkv.bench import generation

    rows = generation(12, 2, layers=1, hidden=64, head_dim=16, caches=("dynamic", "growing"))
    assert [(r.cache, r.implementation) for r in rows] == [("dynamic", "qkv"), ("dynamic", "sdpa"), ("growing", "qkv"), ("growing", "sdpa")]
    assert all(r.first_token_seconds > 0 and r.tokens_per_second > 0 for r in rows)
    with pytest.raises(ValueError, match="caches must be some of dynamic, growing"):
        generation(12, 2, caches=("static",))
