"""`qkv.bench.matmul_gflops` and `machine_matmul_gflops`: 2 n^3 FLOPs over the fastest product."""

from __future__ import annotations

import pytest
import torch

import qkv.native.rates as rates
from qkv.bench import machine_matmul_gflops, matmul_gflops


def test_the_rate_is_two_n_cubed_over_the_fastest_product() -> None:
    ticks = iter(range(1000))

    def clock() -> float:  # every timed product lasts 1 tick of 0.5 s
        return 0.5 * next(ticks)

    # 2 * 64^3 FLOPs in 0.5 s = 1.048576 MFLOP/s
    assert matmul_gflops(torch.float32, side=64, repeats=3, clock=clock) == pytest.approx(2 * 64**3 / 0.5 / 1e9)


def test_the_limit_is_the_best_rate_over_the_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter(range(1000))

    def clock() -> float:  # every timed product lasts 1 tick of 0.5 s, whatever its side
        return 0.5 * next(ticks)

    monkeypatch.setattr(rates, "LIMIT_SIDES", (32, 64, 16))
    # the 64^3 product does 8x the work of the 32^3 one in the same time: its rate is the limit
    assert matmul_gflops(torch.float32, repeats=2, clock=clock) == pytest.approx(2 * 64**3 / 0.5 / 1e9)


def test_the_product_writes_into_one_output(monkeypatch: pytest.MonkeyPatch) -> None:
    outputs: list[int] = []
    real_mm = torch.mm

    def spy(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        outputs.append(out.data_ptr())
        return real_mm(a, b, out=out)

    monkeypatch.setattr(torch, "mm", spy)
    matmul_gflops(torch.float32, side=16, repeats=3)
    assert len(outputs) >= 4 and len(set(outputs)) == 1  # warm-up + 3 rounds, one buffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_measured_rate_is_a_real_product_rate(dtype: torch.dtype) -> None:
    assert matmul_gflops(dtype, side=128, repeats=1) > 0.01


def test_side_must_be_positive() -> None:
    with pytest.raises(ValueError, match="side must be >= 1, got 0"):
        matmul_gflops(side=0)


def test_the_explain_rate_is_measured_once_on_the_threads_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[torch.dtype, int, int]] = []

    def fake(dtype: torch.dtype, *, side: int, repeats: int) -> float:
        seen.append((dtype, side, torch.get_num_threads()))
        return 123.0

    monkeypatch.setattr(rates, "matmul_gflops", fake)
    machine_matmul_gflops.cache_clear()
    threads = torch.get_num_threads()
    try:
        assert machine_matmul_gflops(torch.float16, 1) == 123.0
        assert machine_matmul_gflops(torch.float16, 1) == 123.0
    finally:
        machine_matmul_gflops.cache_clear()
    # at 123 GFLOP/s every probe is quick: 256^2, 512^2, then the 1024^2 product measured, once
    assert seen == [(torch.float16, 256, 1), (torch.float16, 512, 1), (torch.float16, 1024, 1)]
    assert torch.get_num_threads() == threads  # restored


def _fake_rate(monkeypatch: pytest.MonkeyPatch, gflops: float) -> list[int]:
    """matmul_gflops answering ``gflops`` at every side; the sides it was asked for."""
    sides: list[int] = []

    def fake(dtype: torch.dtype, *, side: int, repeats: int) -> float:
        sides.append(side)
        return gflops

    monkeypatch.setattr(rates, "matmul_gflops", fake)
    return sides


def test_an_affordable_side_is_the_one_asked_for_when_its_product_is_quick(monkeypatch: pytest.MonkeyPatch) -> None:
    sides = _fake_rate(monkeypatch, 100.0)  # 2 * 2048^3 FLOPs at 100 GFLOP/s: 0.17 s
    assert rates.affordable_side(torch.float32, 2048, seconds=1.0) == 2048
    assert sides == [256, 512, 1024]  # each probe's product 1/8 of the next one's


def test_an_emulated_rate_gets_a_smaller_side(monkeypatch: pytest.MonkeyPatch) -> None:
    sides = _fake_rate(monkeypatch, 0.3)  # emulated bf16: 2 * 512^3 FLOPs take 0.9 s, 1024^3 7 s
    assert rates.affordable_side(torch.bfloat16, 2048, seconds=1.0) == 512
    assert sides == [256, 512]  # 8 x 0.11 s fits a second, 8 x 0.9 s does not
    assert rates.affordable_side(torch.bfloat16, 2048, seconds=0.01) == 256  # never below the probe's side
    assert rates.affordable_side(torch.bfloat16, 100, seconds=0.01) == 100  # a side below it is kept
