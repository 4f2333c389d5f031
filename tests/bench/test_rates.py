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
    assert seen == [(torch.float16, 1024, 1)]
    assert torch.get_num_threads() == threads  # restored
