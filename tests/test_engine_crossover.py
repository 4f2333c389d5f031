"""'auto' weighs the block engine's fixed cost against SDPA with a dense mask
(`qkv.backends.blocks.crossover`): small structured problems stay on SDPA, large ones go to the
engine, the traced call decides as the eager one, and both routes give the reference's numbers."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.backends.blocks import crossover
from qkv.native import interval_bf16


def _qkv(N: int, H: int, n: int, E: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(N, H, n, E, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3))


def test_the_engine_wins_from_some_length_on_and_keeps_winning() -> None:
    """For a fixed share of the score matrix the engine's estimate grows with n (its rows),
    SDPA's with n squared: below some length SDPA is estimated faster, from it on the engine,
    and more heads or a wider head move that length down."""
    def first_winning_length(N: int, H: int, E: int, share: float, tier: str) -> int:
        wins = [crossover.engine_beats_dense(N, H, n, n, E, share, tier) for n in range(64, 8193, 64)]
        first = wins.index(True)
        assert all(wins[first:]), "once ahead, the engine stays ahead"
        return 64 * (first + 1)

    for tier in ("amx", "avx512", "avx2", "default"):
        base = first_winning_length(1, 4, 32, 0.2, tier)
        assert 256 < base <= 1024, tier  # the engine's measured fixed cost, about a millisecond
        assert first_winning_length(1, 32, 128, 0.2, tier) < base
        assert first_winning_length(1, 4, 32, 0.05, tier) <= base <= first_winning_length(1, 4, 32, 0.5, tier)
        # an engine that computes the whole matrix is never estimated faster than SDPA on it
        assert not any(crossover.engine_beats_dense(1, 8, n, n, 64, 1.0, tier) for n in (256, 1024, 4096, 16384))
    # AVX2's slower float32 products cost SDPA, which does all of them, more than the engine
    wide, narrow = (crossover.dense_ms(1, 8, 1024, 1024, 64, t) / crossover.engine_ms(1, 8, 1024, 1024, 64, 0.2, t) for t in ("amx", "avx2"))
    assert narrow > wide


def test_a_small_window_stays_on_sdpa_and_says_why() -> None:
    q, k, v = _qkv(1, 4, 256, 32)
    mask = qkv.masks.sliding_window(32)
    explained = qkv.explain(q, k, v, mask)
    assert explained.path == "fused"
    assert "fixed cost outweighs the work it skips" in explained.reason
    expected = qkv.attention(q.double(), k.double(), v.double(), mask, backend="math")
    torch.testing.assert_close(qkv.attention(q, k, v, mask).double(), expected, atol=2e-6, rtol=0)
    # asked for by name, the engine still runs, with the same numbers
    torch.testing.assert_close(qkv.attention(q, k, v, mask, backend="blocks").double(), expected, atol=2e-6, rtol=0)


def test_a_long_window_goes_to_the_engine() -> None:
    q, k, v = _qkv(1, 4, 2048, 16)
    mask = qkv.masks.sliding_window(32)
    explained = qkv.explain(q, k, v, mask)
    assert explained.path == "blocks" and "fixed cost" not in explained.reason
    expected = qkv.attention(q.double(), k.double(), v.double(), mask, backend="math")
    torch.testing.assert_close(qkv.attention(q, k, v, mask).double(), expected, atol=2e-6, rtol=0)


def test_the_decision_follows_the_estimates() -> None:
    """Near the crossover 'auto' picks the engine exactly when its estimate, with the share its
    plan computes, is below SDPA's (and the share is under the threshold); the cases cover both
    outcomes and both reasons for SDPA."""
    chosen = set()
    for n in (256, 512, 1024):
        q, k, v = _qkv(1, 2, n, 16)
        for window in (16, 64, 192):
            mask = qkv.masks.sliding_window(window, window)
            share = qkv.explain(q, k, v, mask, backend="blocks").visited_fraction  # the computed share of the plan
            wins = (not crossover.decides(n, n) or crossover.engine_beats_dense(1, 2, n, n, 16, share)) and share <= 0.6
            explained = qkv.explain(q, k, v, mask)
            assert explained.path == ("blocks" if wins else "fused"), (n, window, share)
            chosen.add(explained.path if wins or share > 0.6 else "fused by the estimates")
            if not wins and share <= 0.6:
                assert "fixed cost outweighs the work it skips" in explained.reason
    assert chosen == {"blocks", "fused", "fused by the estimates"}, chosen


@pytest.mark.parametrize(("n", "window", "H"), [(1024, (256, 256), 8), (4096, (1200, 1200), 1)])
def test_wide_windows_beyond_the_models_range_stay_on_the_engine(n: int, window: tuple[int, int], H: int) -> None:
    """Beyond 512 x 512 pairs per head the share threshold alone decides: wide windows with
    E = 128, whose tiles are mostly full, ran 1.2x and 3.2x faster on the engine than on SDPA,
    where the model's estimates, fitted on smaller problems, would have picked SDPA."""
    q = torch.zeros(1, H, n, 128)
    mask = qkv.masks.sliding_window(*window)
    share = qkv.explain(q, q, q, mask, backend="blocks").visited_fraction
    assert 0.45 < share <= 0.6
    assert not crossover.decides(n, n)
    assert not crossover.engine_beats_dense(1, H, n, n, 128, share, "amx")  # the model alone would refuse
    assert qkv.explain(q, q, q, mask).path == "blocks"


def test_the_fused_bf16_interval_kernel_is_judged_by_the_share_alone() -> None:
    """The fused bf16 interval kernel's fixed cost is a fraction of the portable engine's: where
    it runs, a small window still goes to it; where it cannot, the cost model sends the call to
    SDPA, as for float32."""
    q, k, v = _qkv(1, 4, 256, 32, dtype=torch.bfloat16)
    mask = qkv.masks.sliding_window(32)
    explained = qkv.explain(q, k, v, mask)
    if interval_bf16.unavailable_reason(torch.bfloat16, q.device, True) is None:
        assert explained.path == "blocks" and explained.kernels[0] == "interval_bf16"
    else:
        assert explained.path == "fused"
    with qkv.backends.disabled("interval_bf16"):
        assert qkv.explain(q, k, v, mask).path == "fused"


def test_traced_auto_decides_as_eager_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    from qkv.attention import dispatch, functional

    seen: list[str] = []
    real = dispatch.choose_path

    def spy(*args: object, **kwargs: object) -> dispatch.Plan:
        plan = real(*args, **kwargs)  # type: ignore[arg-type]
        seen.append(plan.path)
        return plan

    monkeypatch.setattr(functional, "choose_path", spy)
    ids_small, ids_large = (torch.repeat_interleave(torch.arange(4), n // 4) for n in (256, 2048))
    for n, mask in ((256, qkv.masks.sliding_window(32)), (2048, qkv.masks.sliding_window(32)),
                    (256, qkv.masks.documents(ids_small)), (2048, qkv.masks.documents(ids_large))):
        q, k, v = _qkv(1, 4, n, 16)
        seen.clear()
        eager = qkv.attention(q, k, v, mask)
        torch._dynamo.reset()
        compiled = torch.compile(lambda q, k, v, mask=mask: qkv.attention(q, k, v, mask), backend="aot_eager", fullgraph=True)(q, k, v)
        assert seen[0] == seen[1] == ("fused" if n == 256 else "blocks"), (n, mask, seen)
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=0)
    torch._dynamo.reset()
