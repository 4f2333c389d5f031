"""`qkv.kernels.machine` and what `qkv.explain` says about the machine (its flags, and the
rates of `qkv.bench.machine_matmul_gflops` when asked)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import qkv
import qkv.bench
from qkv.kernels import machine


def test_flags_come_from_proc_cpuinfo() -> None:
    flags = machine.cpu_flags()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        assert flags is None
        return
    first = next(line for line in text.splitlines() if line.startswith("flags"))
    assert flags == frozenset(first.split(":", 1)[1].split())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_explain_warns_of_emulated_low_precision(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    q = torch.randn(1, 2, 8, 4).to(dtype)
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"sse2", "avx2", "avx512f"}))
    notes = qkv.explain(q, q, q).notes
    assert len(notes) == 1 and "emulates" in notes[0] and str(dtype).removeprefix("torch.") in notes[0]
    assert f"note: {notes[0]}" in str(qkv.explain(q, q, q))
    native = {torch.bfloat16: "amx_bf16", torch.float16: "avx512_fp16"}[dtype]
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"avx2", native}))
    assert qkv.explain(q, q, q).notes == ()
    monkeypatch.setattr(machine, "cpu_flags", lambda: None)  # not Linux: nothing is claimed
    assert qkv.explain(q, q, q).notes == ()


def test_float32_gets_no_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset())
    q = torch.randn(1, 2, 8, 4)
    assert qkv.explain(q, q, q).notes == ()


def test_rates_are_measured_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 2, 8, 4).to(torch.bfloat16)
    calls: list[torch.dtype] = []

    def fake_rate(dtype: torch.dtype, threads: int) -> float:
        calls.append(dtype)
        return {torch.float32: 400.0, torch.bfloat16: 2000.0}[dtype]

    monkeypatch.setattr(qkv.bench, "machine_matmul_gflops", fake_rate)
    plain = qkv.explain(q, q, q)
    assert plain.matmul_rates == () and calls == [] and "machine:" not in str(plain)
    measured = qkv.explain(q, q, q, measure=True)
    assert measured.matmul_rates == (("float32", 400.0), ("bfloat16", 2000.0))
    assert calls == [torch.float32, torch.bfloat16]
    text = str(measured)
    assert "machine: matmul float32 400, bfloat16 2000 GFLOP/s" in text
    # 4 * B * H * L * S * E = 4 * 2 * 8 * 8 * 4 FLOPs at 2000 GFLOP/s
    assert f"{4 * 2 * 8 * 8 * 4 / 2000e9 * 1e3:.2f} ms at the bfloat16 matmul rate" in text
