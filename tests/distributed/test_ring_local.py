"""Ring attention on a lone rank (no process group), its block schedule and its merge step.

World size 1 runs the same forward and backward code as a real ring, minus the transfers,
so the arithmetic (query tiles, causal diagonal, GQA, E != Ev, float32 accumulation) is
checked here cheaply; the multi-process worlds are in test_ring_world.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import qkv
from qkv.backends.merge import merge_partial
from qkv.distributed import RingStats, ring_attention
from qkv.distributed import blockwise as blockwise_module
from qkv.distributed.blockwise import block_forward
from qkv.distributed.layout import shard_chunks
from qkv.distributed.ring import _schedule
from tests.distributed._ring_cases import RingCase, block_settings, naive, reference, single_process


def _ring_single(case: RingCase, arrays: dict[str, np.ndarray], dtype: torch.dtype) -> dict[str, np.ndarray]:
    q, k, v = (torch.from_numpy(arrays[n]).to(dtype).requires_grad_() for n in ("q", "k", "v"))
    with block_settings(case):
        out = ring_attention(q, k, v, causal=case.causal, layout=case.layout, scale=case.scale)  # type: ignore[arg-type]
        assert out.dtype == dtype
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.from_numpy(arrays["d_out"]).to(dtype))
    return {"out": out.detach().double().numpy(), "dq": dq.double().numpy(),
            "dk": dk.double().numpy(), "dv": dv.double().numpy()}


@pytest.mark.parametrize(
    "case",
    [
        # 600 rows are three query tiles of 256: the causal diagonal spans tile boundaries
        RingCase("tiles-causal", 600, True, "contiguous", H=2, G=1, E=16, Ev=9, B=1),
        RingCase("tiles-full", 600, False, "zigzag", H=2, G=2, E=4, Ev=4, B=1, scale=0.7, tiles=True),
        RingCase("flash-causal", 600, True, "zigzag", H=4, G=2, E=8, Ev=8, B=1),
        RingCase("zigzag-one-rank-causal", 7, True, "zigzag", H=6, G=3, E=5, Ev=2, B=None),
        RingCase("single-token", 1, True, "contiguous", H=2, G=1, E=3, Ev=3),
    ],
    ids=lambda c: c.name,
)
def test_lone_rank_matches_single_process(case: RingCase) -> None:
    arrays = case.inputs(seed=7)
    got = _ring_single(case, arrays, torch.float64)
    single, ref = single_process(case, arrays, torch.float64), reference(case, arrays)
    for f in ("out", "dq", "dk", "dv"):
        assert np.max(np.abs(got[f] - single[f])) < 1e-10, f
        assert np.max(np.abs(got[f] - ref[f])) < 1e-10, f


def test_more_batch_dims() -> None:
    q, k, v = torch.randn(2, 3, 4, 9, 8, dtype=torch.float64), torch.randn(2, 3, 2, 9, 8, dtype=torch.float64), \
        torch.randn(2, 3, 2, 9, 6, dtype=torch.float64)
    out = ring_attention(q, k, v, causal=True)
    assert out.shape == (2, 3, 4, 9, 6)
    expected = qkv.attention(q, k, v, qkv.masks.causal())
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("tiles", [False, True], ids=["flash", "tiles"])
def test_bfloat16_by_the_tolerance_rule(tiles: bool) -> None:
    case = RingCase("bf16", 300, True, "zigzag", H=4, G=2, E=16, Ev=16, B=1, tiles=tiles)
    arrays = case.inputs(seed=3)
    got, ref = _ring_single(case, arrays, torch.bfloat16), reference(case, arrays)
    low = naive(case, arrays, torch.bfloat16)
    for f in ("out", "dq", "dk", "dv"):
        factor = 2.0 if f == "out" else 3.0
        naive_err = float(np.max(np.abs(low[f].astype(np.float64) - ref[f])))
        assert float(np.max(np.abs(got[f] - ref[f]))) <= factor * naive_err + 1e-3, f


def test_stats_count_the_causal_work() -> None:
    stats = RingStats()
    x = torch.randn(1, 2, 10, 4, requires_grad=True)
    ring_attention(x, x, x, causal=True, stats=stats).sum().backward()
    assert stats.visited_pairs == 10 * 11 // 2
    assert stats.chunk_pairs == 1 and stats.chunk_pairs_skipped == 0
    assert stats.forward_compute_s > 0 and stats.backward_compute_s > 0


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_schedule_balances_zigzag_and_skips_the_future(world_size: int) -> None:
    """Visited (query, key) pairs per rank over a whole ring pass, from the block schedule."""
    seq_len = 16 * world_size
    work: dict[str, list[int]] = {}
    for name in ("contiguous", "zigzag"):
        chunks = [shard_chunks(seq_len, r, world_size, name) for r in range(world_size)]  # type: ignore[arg-type]
        work[name] = []
        for r in range(world_size):
            blocks = [b for src in range(world_size) for b in _schedule(chunks[r], chunks[src], True)[0]]
            assert all(b.k0 < b.k1 and b.q0 < b.q1 for b in blocks)
            work[name].append(sum(b.visited for b in blocks))
        assert sum(work[name]) == seq_len * (seq_len + 1) // 2
    assert len(set(work["zigzag"])) == 1
    c = seq_len // world_size
    assert work["contiguous"] == [r * c * c + c * (c + 1) // 2 for r in range(world_size)]


def test_merge_of_two_key_halves_is_exact_and_empty_rows_stay_zero() -> None:
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    k, v = torch.randn(1, 1, 9, 4, dtype=torch.float64), torch.randn(1, 1, 9, 3, dtype=torch.float64)
    out = torch.zeros(1, 2, 5, 3, dtype=torch.float64)
    lse = torch.full((1, 2, 5), float("-inf"), dtype=torch.float64)
    for keys in (slice(0, 4), slice(4, 9)):
        merge_partial(out, lse, *block_forward(q, k[:, :, keys], v[:, :, keys], 0.5, False))
    expected, expected_lse = qkv.attention(q, k, v, scale=0.5, return_lse=True)  # type: ignore[misc]
    assert torch.allclose(out, expected, atol=1e-13, rtol=0)
    assert torch.allclose(lse, expected_lse, atol=1e-13, rtol=0)
    # a row that has seen no key merged with a block of no key: zeros and -inf, no NaN
    empty_out, empty_lse = torch.zeros(1, 1, 1, 3), torch.full((1, 1, 1), float("-inf"))
    merge_partial(empty_out, empty_lse, torch.zeros(1, 1, 1, 3), torch.full((1, 1, 1), float("-inf")))
    assert torch.equal(empty_out, torch.zeros(1, 1, 1, 3)) and math.isinf(empty_lse.item())


def test_query_tile_setting_does_not_change_the_result() -> None:
    x = torch.randn(1, 2, 37, 8, dtype=torch.float64)
    expected = ring_attention(x, x, x, causal=True)
    default = blockwise_module.QUERY_TILE
    try:
        blockwise_module.QUERY_TILE = 5
        tiled = ring_attention(x, x, x, causal=True)
    finally:
        blockwise_module.QUERY_TILE = default
    assert torch.allclose(tiled, expected, atol=1e-13, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"k": torch.randn(1, 2, 5, 8), "v": torch.randn(1, 2, 5, 8)}, ValueError, "self-attention over one sharded"),
        ({"causal": 1}, TypeError, "causal must be a bool"),
        ({"layout": "ring"}, ValueError, "layout must be one of"),
        ({"timeout": 0}, ValueError, "positive, finite"),
        ({"timeout": "5s"}, TypeError, "timeout must be seconds"),
        ({"stats": {}}, TypeError, "stats must be a RingStats"),
        ({"group": object()}, ValueError, "torch.distributed is not initialised"),
        ({"v": torch.randn(1, 3, 6, 8)}, ValueError, "same number of heads"),
        ({"q": torch.randn(1, 2, 1, 8), "k": torch.randn(1, 2, 1, 8), "v": torch.randn(1, 2, 1, 8),
          "layout": "zigzag"}, ValueError, "at least 2 tokens"),
    ],
)
def test_bad_inputs_raise_before_any_work(kwargs: dict, error: type[Exception], message: str) -> None:
    args = {"q": torch.randn(1, 2, 6, 8), "k": torch.randn(1, 2, 6, 8), "v": torch.randn(1, 2, 6, 8), **kwargs}
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(error, match=message):
        ring_attention(q, k, v, **args)
