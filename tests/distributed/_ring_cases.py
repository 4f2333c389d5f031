"""Cases for ring attention worlds, the code each rank runs, and the single-process oracles.

Inputs are drawn in the parent as float64 NumPy arrays; every rank cuts its own shard with
`qkv.distributed.shard`, runs ring attention forward and backward, and sends back its shards
of the output and of the gradients. The parent reassembles them with `unshard` and compares
them with single-process `qkv.attention` and the float64 NumPy `qkv.reference`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import qkv
from qkv.distributed import RingStats, ring_attention, shard
from qkv.distributed import blockwise as blockwise_module
from tests.distributed._world import Rank

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class RingCase:
    name: str
    L: int  # total sequence length
    causal: bool
    layout: str
    H: int = 4
    G: int = 2
    E: int = 8
    Ev: int = 5
    B: int | None = 2  # None: no batch dim, tensors (H, L, E)
    dtype: str = "float64"
    scale: float | None = None
    tile: int | None = None  # QUERY_TILE for this case, to cut shards into several tiles
    tiles: bool = False  # force the tiles where PyTorch's CPU flash kernel would apply (E == Ev)

    def shape(self, heads: int, dim: int) -> tuple[int, ...]:
        return (heads, self.L, dim) if self.B is None else (self.B, heads, self.L, dim)

    def inputs(self, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {
            "q": rng.standard_normal(self.shape(self.H, self.E)),
            "k": rng.standard_normal(self.shape(self.G, self.E)),
            "v": rng.standard_normal(self.shape(self.G, self.Ev)),
            "d_out": rng.standard_normal(self.shape(self.H, self.Ev)),
        }


def cases(world_size: int) -> list[RingCase]:
    P = world_size
    # E != Ev runs blocks as tiles, E == Ev through PyTorch's CPU flash kernel (see blockwise)
    return [
        RingCase("contiguous-causal-gqa-tiles", 8 * P, True, "contiguous", tile=3),
        RingCase("zigzag-causal-gqa-tiles", 8 * P, True, "zigzag", tile=3),
        RingCase("contiguous-causal-gqa-flash", 8 * P, True, "contiguous", Ev=8),
        RingCase("zigzag-causal-gqa-flash", 8 * P, True, "zigzag", Ev=8),
        RingCase("contiguous-full-tiles", 8 * P, False, "contiguous", H=2, G=2, Ev=8, scale=0.3, tiles=True),
        RingCase("zigzag-full-gqa-tiles", 8 * P, False, "zigzag", H=6, G=2, E=3, Ev=7),
        RingCase("contiguous-causal-uneven-flash", 8 * P + 3, True, "contiguous", H=3, G=1, Ev=8),
        RingCase("zigzag-causal-uneven-nobatch-flash", 8 * P + 5, True, "zigzag", B=None, Ev=8),
        RingCase("zigzag-causal-uneven-nobatch-tiles", 8 * P + 5, True, "zigzag", B=None, tile=2),
        RingCase("zigzag-full-uneven-flash", 4 * P + 1, False, "zigzag", H=2, G=1, E=4, Ev=4),
        RingCase("contiguous-causal-f32-flash", 32 * P, True, "contiguous", dtype="float32", E=16, Ev=16),
        RingCase("zigzag-causal-f32-tiles", 32 * P, True, "zigzag", dtype="float32", E=16, Ev=12, tile=16),
        RingCase("zigzag-full-f32-flash", 32 * P, False, "zigzag", dtype="float32", E=16, Ev=16),
    ]


@contextmanager
def block_settings(case: RingCase) -> Iterator[None]:
    """Apply the case's QUERY_TILE and path choice to qkv.distributed.blockwise, then restore them."""
    saved = blockwise_module.QUERY_TILE
    blockwise_module.QUERY_TILE = case.tile or saved
    try:
        with qkv.backends.disabled(*(("ring_cpu_flash",) if case.tiles else ())):
            yield
    finally:
        blockwise_module.QUERY_TILE = saved


def run_case(me: Rank, case: RingCase, arrays: dict[str, np.ndarray], group: dist.ProcessGroup | None = None,
             rank: int | None = None, size: int | None = None) -> dict[str, Any]:
    """This rank's shards of (out, dq, dk, dv) for one case, and its RingStats."""
    rank = me.rank if rank is None else rank
    size = me.size if size is None else size
    dtype = DTYPES[case.dtype]
    full = {name: torch.from_numpy(a).to(dtype) for name, a in arrays.items()}
    mine = {name: shard(x, rank, size, case.layout).clone() for name, x in full.items()}  # type: ignore[arg-type]
    q, k, v = (mine[n].requires_grad_() for n in ("q", "k", "v"))
    stats = RingStats()
    with block_settings(case):
        out = ring_attention(q, k, v, causal=case.causal, layout=case.layout, group=group,  # type: ignore[arg-type]
                             scale=case.scale, timeout=30.0, stats=stats)
        assert blockwise_module.block_path(q, v) == ("tiles" if case.tiles or case.Ev != case.E else "cpu-flash")
        out.backward(mine["d_out"])
    return {
        "out": out.detach().numpy(),
        "dq": q.grad.numpy(),  # type: ignore[union-attr]
        "dk": k.grad.numpy(),  # type: ignore[union-attr]
        "dv": v.grad.numpy(),  # type: ignore[union-attr]
        "stats": stats,
        "out_dtype": str(out.dtype),
    }


def _expect_error(fn: Any) -> tuple[str, str, float]:
    start = time.perf_counter()
    try:
        fn()
    except Exception as error:  # the caller checks the type and the message
        return type(error).__name__, str(error), time.perf_counter() - start
    return "no error", "", time.perf_counter() - start


def world_suite(me: Rank, payload: dict[str, Any]) -> dict[str, Any]:
    """Everything one world checks: the cases, sub-rings, bad inputs, then stalled peers."""
    torch.manual_seed(1234 + me.rank)
    result: dict[str, Any] = {"cases": {}}
    for case, arrays in payload["cases"]:
        result["cases"][case.name] = run_case(me, case, arrays)

    # Rings on subgroups: pairs of ranks {0, 1}, {2, 3}, ... each run their own sequence.
    if me.size % 2 == 0 and me.size > 2:
        pairs = [dist.new_group([r, r + 1]) for r in range(0, me.size, 2)]
        case, arrays_by_pair = payload["subgroup"]
        pair = me.rank // 2
        result["subgroup"] = run_case(me, case, arrays_by_pair[pair], group=pairs[pair], rank=me.rank % 2, size=2)

    # Ranks that disagree on shapes: every rank must raise the same ValueError.
    H = 4 if me.rank == 0 else 2
    x = torch.randn(1, H, 4, 8, dtype=torch.float64)
    kv = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    result["mismatch"] = _expect_error(lambda: ring_attention(x, kv, kv, timeout=30.0))

    # Shard lengths that no layout produces (a 9-token sequence split 4 + 5 over 2 ranks): rejected.
    if me.size == 2:
        n = 4 if me.rank == 0 else 5
        y = torch.randn(1, 2, n, 8, dtype=torch.float64)
        result["bad_lengths"] = _expect_error(lambda: ring_attention(y, y, y, causal=True, timeout=30.0))

    me.publish(result)
    result = {}
    if me.size == 2:
        _stalled_peers(me, payload["fault_timeout"], result)
    else:
        _crashed_peer(me, payload["fault_timeout"], result)
    return result


def _stalled_peers(me: Rank, timeout: float, result: dict[str, Any]) -> None:
    """Peers that stall: rank 0 must raise RingCommunicationError after about `timeout`.

    Gloo closes a group's connections after a timeout, so each stall uses a group of its own:
    first a fresh two-rank group on which rank 1 never calls (the shape all_gather times out),
    then the default group, on which rank 1 runs the forward but never the backward (the
    ring's own point-to-point waits time out).
    """
    spare = dist.new_group([0, 1])
    z = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    if me.rank == 0:
        result["stalled_forward"] = _expect_error(lambda: ring_attention(z, z, z, group=spare, timeout=timeout))
        me.store.set("stalled_forward_done", "1")
    else:
        me.store.wait(["stalled_forward_done"])
    out = ring_attention(z, z, z, causal=True, timeout=timeout)
    if me.rank == 0:
        result["stalled_backward"] = _expect_error(lambda: out.sum().backward())
        me.store.set("rank0_done", "1")
    else:
        me.store.wait(["rank0_done"])  # stay alive (and silent) until rank 0 has given up
    me.abandon = True  # the groups are broken now: skip the normal teardown


def _crashed_peer(me: Rank, timeout: float, result: dict[str, Any]) -> None:
    """The last rank exits right after the forward; every other rank's backward must fail fast."""
    z = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    out = ring_attention(z, z, z, causal=True, layout="zigzag", timeout=timeout)
    if me.rank == me.size - 1:
        os._exit(3)
    result["crashed"] = _expect_error(lambda: out.sum().backward())
    me.abandon = True


# ----------------------------------------------------------------------------- oracles (parent)


def single_process(case: RingCase, arrays: dict[str, np.ndarray], dtype: torch.dtype) -> dict[str, np.ndarray]:
    """Output and gradients of `qkv.attention` on the whole sequence, in one process."""
    q, k, v = (torch.from_numpy(arrays[n]).to(dtype).requires_grad_() for n in ("q", "k", "v"))
    mask = qkv.masks.causal() if case.causal else None
    out = qkv.attention(q, k, v, mask, scale=case.scale)
    assert isinstance(out, torch.Tensor)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.from_numpy(arrays["d_out"]).to(dtype))
    return {"out": out.detach().numpy(), "dq": dq.numpy(), "dk": dk.numpy(), "dv": dv.numpy()}


def reference(case: RingCase, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The float64 NumPy reference (forward and its hand-written chain rule)."""
    mask = qkv.masks.causal().to_dense(case.L, case.L).numpy() if case.causal else None
    trace = qkv.reference.attention(arrays["q"], arrays["k"], arrays["v"], mask, case.scale)
    dq, dk, dv = qkv.reference.attention_grads(trace, arrays["d_out"])
    return {"out": trace.output, "dq": dq, "dk": dk, "dv": dv}


def naive(case: RingCase, arrays: dict[str, np.ndarray], dtype: torch.dtype) -> dict[str, np.ndarray]:
    """softmax(q k^T * scale + mask) v written out in `dtype`, differentiated by autograd."""
    q, k, v = (torch.from_numpy(arrays[n]).to(dtype).requires_grad_() for n in ("q", "k", "v"))
    r = case.H // case.G
    kk, vv = k.repeat_interleave(r, dim=-3), v.repeat_interleave(r, dim=-3)  # (..., H, L, E), (..., H, L, Ev)
    scale = case.scale if case.scale is not None else case.E**-0.5
    scores = q @ kk.transpose(-1, -2) * scale  # (..., H, L, L)
    if case.causal:
        scores = scores.masked_fill(~torch.ones(case.L, case.L, dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vv  # (..., H, L, Ev)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.from_numpy(arrays["d_out"]).to(dtype))
    return {n: t.detach().double().numpy() for n, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))}
