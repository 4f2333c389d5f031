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
