"""Ring attention over torch.distributed: exact attention of a sequence sharded across ranks.

Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context"; the causal load balancing of the zigzag layout follows Brandon et al. 2023,
"Striped Attention" (see `qkv.distributed.layout`).

Forward, on each of the P ranks of the ring, for step t = 0 .. P-1: the rank holds the
key/value shard of rank src = (rank - t) mod P. It first posts the non-blocking transfer of
that shard to rank + 1 (and the receive of the next one from rank - 1), then computes its
queries against the shard it holds (`blockwise.block_forward`), folds the block's (out, lse)
into the running (out, lse) with log-sum-exp in float32 (`qkv.backends.merge.merge_partial`),
and only then waits for the transfer: communication overlaps compute.

Backward (a custom autograd Function; only the inputs, the output and the lse are saved):
key/value shards travel the ring again. Every rank adds its dq locally and its contribution
to dk, dv of the block it holds into an accumulator that travels one step behind the block,
so after P steps each accumulator arrives back at the rank owning that block, complete.

Causal: the mask is the one of the full, unsharded sequence (L == S, so top-left and
bottom-right alignment coincide). A (query chunk, key chunk) pair is computed whole when
every key precedes every query, skipped when every key lies in the future (so no row is ever
empty and no NaN can appear), and computed with a causal diagonal when both are the same
chunk.

World size 1 works, and needs no process group: with group=None and torch.distributed not
initialised, the rank is alone and nothing is communicated.

Every wait is bounded by `timeout` (and the process group's own timeout bounds the work it
runs): a crashed or stalled peer ends the call with `RingCommunicationError`, never a hang.
Dropout is not supported (ring attention here is for inference and for exact training
without attention dropout); pass attention dropout through `qkv.attention` instead.

Shape legend: B batch (any leading dims, flattened to N), H query heads, G key/value heads,
L_r tokens of this rank's shard, E q/k head dim, Ev value head dim, P ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from qkv.attention.problem import describe_problem
from qkv.backends.merge import merge_partial
from qkv.backends.softmax import accumulation_dtype
from qkv.distributed.blockwise import block_backward, block_forward
from qkv.distributed.layout import Chunk, Layout, check_layout, shard_chunks, shard_lengths

__all__ = ["DEFAULT_TIMEOUT", "RingCommunicationError", "RingStats", "ring_attention"]

# Longest wait for one transfer. A wait covers the peer's compute of one step, which on CPU
# with long shards takes seconds to minutes, so the default is generous; tests use ~seconds.
DEFAULT_TIMEOUT = timedelta(minutes=5)

# Tags keep the four streams of a ring apart when next and previous rank are the same (P = 2)
# and k/v blocks and dk/dv accumulators of different lengths are in flight together.
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 11, 12, 13, 14

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class RingCommunicationError(RuntimeError):
    """A transfer of the ring failed or timed out: a peer crashed, stalled or never called."""


@dataclass
class RingStats:
    """Where one rank's time went; pass one to `ring_attention(stats=...)` to have it filled.

    Times are wall-clock seconds on this rank (on CUDA they measure launch, not execution).
    Counters are per call summed over calls: chunk pairs computed / skipped under the layout,
    and (query, key) pairs visited per batch row and head, the measure of causal work.
    """

    forward_compute_s: float = 0.0  # blocks and merges
    forward_wait_s: float = 0.0  # waiting for k/v transfers (and the metadata exchange)
    backward_compute_s: float = 0.0
    backward_wait_s: float = 0.0  # waiting for k/v blocks and dk/dv accumulators
    chunk_pairs: int = 0  # (query chunk, key chunk) pairs computed in the forward
    chunk_pairs_skipped: int = 0  # pairs whose keys are all in the queries' future
    visited_pairs: int = 0  # (query, key) pairs computed in the forward


@dataclass(frozen=True)
class _Ring:
    """The ring of a process group: this rank's place, its neighbours, and the wait bound."""

    group: dist.ProcessGroup | None  # None: a single rank without torch.distributed
    rank: int
    size: int
    timeout: timedelta

    @staticmethod
    def create(group: dist.ProcessGroup | None, timeout: timedelta) -> _Ring:
        initialized = dist.is_available() and dist.is_initialized()
        if group is None and not initialized:
            return _Ring(None, 0, 1, timeout)
        if not initialized:
            raise ValueError("a process group was passed as `group` but torch.distributed is not initialised")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of the process group passed as `group`")
        return _Ring(group, rank, dist.get_world_size(group), timeout)

    def _global(self, offset: int) -> int:
        group_rank = (self.rank + offset) % self.size
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def shift(
        self, sends: Sequence[torch.Tensor], recv_shapes: Sequence[tuple[int, ...]], tags: Sequence[int], what: str
    ) -> _Transfer:
        """Post: send `sends` to rank + 1, receive same-dtype tensors of `recv_shapes` from rank - 1."""
        nxt, prv = self._global(1), self._global(-1)
        recvs = [torch.empty(shape, dtype=s.dtype, device=s.device) for s, shape in zip(sends, recv_shapes, strict=True)]
        ops = [dist.P2POp(dist.isend, s, nxt, self.group, tag) for s, tag in zip(sends, tags, strict=True)]
        ops += [dist.P2POp(dist.irecv, r, prv, self.group, tag) for r, tag in zip(recvs, tags, strict=True)]
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as error:
            raise RingCommunicationError(f"rank {self.rank}: posting {what} failed: {error}") from error
        return _Transfer(self, works, recvs, what)

    def all_gather(self, x: torch.Tensor, what: str) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        work = dist.all_gather(parts, x, group=self.group, async_op=True)
        _wait(self, work, what)
        return parts


@dataclass
class _Transfer:
    ring: _Ring
    works: list[dist.Work]
    received: list[torch.Tensor]
    what: str

    def wait(self) -> list[torch.Tensor]:
        """Wait for every send and receive, at most ring.timeout in all."""
        deadline = time.monotonic() + self.ring.timeout.total_seconds()
        for work in self.works:
            _wait(self.ring, work, self.what, deadline)
        return self.received


# A wait of zero means "no limit" to torch.distributed: never ask for less than this.
_MIN_WAIT = timedelta(milliseconds=1)


def _wait(ring: _Ring, work: dist.Work, what: str, deadline: float | None = None) -> None:
    """Wait for one communication until `deadline` (default: ring.timeout from now).

    Failures name the rank, the step and the peer.
    """
    limit = ring.timeout if deadline is None else max(_MIN_WAIT, timedelta(seconds=deadline - time.monotonic()))
    try:
        done = work.wait(limit)
    except RuntimeError as error:
        raise RingCommunicationError(
            f"rank {ring.rank} of {ring.size}: {what} failed or timed out after at most "
            f"{ring.timeout.total_seconds():g} s (a peer crashed, stalled, or did not call ring_attention): {error}"
        ) from error
    if done is False:
        raise RingCommunicationError(f"rank {ring.rank} of {ring.size}: {what} timed out after {ring.timeout}")


@dataclass(frozen=True)
class _Block:
    """Rows [q0, q1) of the query shard against rows [k0, k1) of a key/value shard."""

    q0: int
    q1: int
    k0: int
    k1: int
    diagonal: bool  # causal, same positions: query i sees keys up to i

    @property
    def visited(self) -> int:
        n = self.q1 - self.q0
        return n * (n + 1) // 2 if self.diagonal else n * (self.k1 - self.k0)


def _schedule(q_chunks: tuple[Chunk, ...], k_chunks: tuple[Chunk, ...], causal: bool) -> tuple[list[_Block], int, int]:
    """Blocks to compute for one (query shard, key shard) step: (blocks, pairs computed, skipped).

    Chunks of a layout are disjoint runs of positions, so under a causal mask a key chunk lies
    wholly before a query chunk (full block), wholly after it (skipped) or is the same chunk
    (diagonal). Neighbouring full blocks that share rows or columns are fused into one.
    """
    if not causal:
        q_len, k_len = sum(c.length for c in q_chunks), sum(c.length for c in k_chunks)
        return [_Block(0, q_len, 0, k_len, False)], len(q_chunks) * len(k_chunks), 0
    blocks: list[_Block] = []
    skipped = 0
    for qc in q_chunks:
        for kc in k_chunks:
            if kc.stop <= qc.start:
                block = _Block(qc.offset, qc.offset + qc.length, kc.offset, kc.offset + kc.length, False)
            elif kc.start >= qc.stop:
                skipped += 1
                continue
            else:
                assert (kc.start, kc.stop) == (qc.start, qc.stop), "chunks of a layout never overlap partly"
                block = _Block(qc.offset, qc.offset + qc.length, kc.offset, kc.offset + kc.length, True)
            blocks.append(block)
    computed = len(blocks)
    fused: list[_Block] = []
    for b in blocks:
        last = fused[-1] if fused else None
        if last is not None and not (last.diagonal or b.diagonal):
            if (last.k0, last.k1) == (b.k0, b.k1) and last.q1 == b.q0:
                fused[-1] = _Block(last.q0, b.q1, b.k0, b.k1, False)
                continue
            if (last.q0, last.q1) == (b.q0, b.q1) and last.k1 == b.k0:
                fused[-1] = _Block(b.q0, b.q1, last.k0, b.k1, False)
                continue
        fused.append(b)
    return fused, computed, skipped


@dataclass(frozen=True)
class _Plan:
    ring: _Ring
    chunks: tuple[tuple[Chunk, ...], ...]  # chunks[r]: the chunks rank r holds
    causal: bool
    scale: float
    stats: RingStats | None

    def length(self, rank: int) -> int:
        return sum(c.length for c in self.chunks[rank])

    def source(self, step: int) -> int:
        """Rank whose key/value shard this rank holds at `step`."""
        return (self.ring.rank - step) % self.ring.size


class _RingAttention(torch.autograd.Function):
    """out = softmax(q k^T * scale [+ causal]) v over the whole ring; see the module docstring."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan) -> torch.Tensor:  # type: ignore[override]
        ring, P = plan.ring, plan.ring.size
        acc = accumulation_dtype(q.dtype)
        N, H, L, _ = q.shape
        G, Ev = v.shape[1], v.shape[3]
        q_acc = q.to(acc)
        out = torch.zeros(N, H, L, Ev, dtype=acc, device=q.device)  # running normalized output
        lse = torch.full((N, H, L), float("-inf"), dtype=acc, device=q.device)  # running log-sum-exp
        k_cur, v_cur = k.contiguous(), v.contiguous()
        compute_s = wait_s = 0.0
        for step in range(P):
            transfer = None
            if step + 1 < P:
                n = plan.length(plan.source(step + 1))
                transfer = ring.shift(
                    [k_cur, v_cur], [(N, G, n, k.shape[3]), (N, G, n, Ev)], [_TAG_K, _TAG_V],
                    f"forward step {step + 1}/{P - 1}: k/v shard from rank {(ring.rank - 1) % P}",
                )
            start = time.perf_counter()
            blocks, computed, skipped = _schedule(plan.chunks[ring.rank], plan.chunks[plan.source(step)], plan.causal)
            k_acc, v_acc = (k_cur.to(acc), v_cur.to(acc)) if blocks else (k_cur, v_cur)
            for b in blocks:
                block_out, block_lse = block_forward(
                    q_acc[:, :, b.q0:b.q1], k_acc[:, :, b.k0:b.k1], v_acc[:, :, b.k0:b.k1], plan.scale, b.diagonal
                )
                merge_partial(out[:, :, b.q0:b.q1], lse[:, :, b.q0:b.q1], block_out, block_lse)
            compute_s += time.perf_counter() - start
            if plan.stats is not None:
                plan.stats.chunk_pairs += computed
                plan.stats.chunk_pairs_skipped += skipped
                plan.stats.visited_pairs += sum(b.visited for b in blocks)
            if transfer is not None:
                start = time.perf_counter()
                k_cur, v_cur = transfer.wait()
                wait_s += time.perf_counter() - start
        if plan.stats is not None:
            plan.stats.forward_compute_s += compute_s
            plan.stats.forward_wait_s += wait_s
        result = out.to(q.dtype)  # (N, H, L_r, Ev)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.plan = plan
        return result

    @staticmethod
    def backward(ctx, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        plan: _Plan = ctx.plan
        ring, P = plan.ring, plan.ring.size
        acc = lse.dtype
        N, H, L, E = q.shape
        G, Ev = v.shape[1], v.shape[3]
        q_acc, d_out_acc, out_acc = q.to(acc), d_out.to(acc), out.to(acc)
        delta = (d_out_acc * out_acc).sum(dim=-1)  # (N, H, L_r): rowsum(dO * O)
        dq = torch.zeros(N, H, L, E, dtype=acc, device=q.device)
        k_cur, v_cur = k.contiguous(), v.contiguous()
        incoming: _Transfer | None = None  # dk/dv accumulator of the next block, from rank - 1
        compute_s = wait_s = 0.0
        for step in range(P):
            src = plan.source(step)
            transfer = None
            if step + 1 < P:
                n = plan.length(plan.source(step + 1))
                transfer = ring.shift(
                    [k_cur, v_cur], [(N, G, n, E), (N, G, n, Ev)], [_TAG_K, _TAG_V],
                    f"backward step {step + 1}/{P - 1}: k/v shard from rank {(ring.rank - 1) % P}",
                )
            start = time.perf_counter()
            n_src = plan.length(src)
            dk = torch.zeros(N, G, n_src, E, dtype=acc, device=q.device)  # this rank's share for block src
            dv = torch.zeros(N, G, n_src, Ev, dtype=acc, device=q.device)
            blocks, _, _ = _schedule(plan.chunks[ring.rank], plan.chunks[src], plan.causal)
            k_acc, v_acc = (k_cur.to(acc), v_cur.to(acc)) if blocks else (k_cur, v_cur)
            for b in blocks:
                block_backward(
                    q_acc[:, :, b.q0:b.q1], k_acc[:, :, b.k0:b.k1], v_acc[:, :, b.k0:b.k1],
                    out_acc[:, :, b.q0:b.q1], d_out_acc[:, :, b.q0:b.q1], lse[:, :, b.q0:b.q1],
                    delta[:, :, b.q0:b.q1],
                    plan.scale, b.diagonal,
                    dq[:, :, b.q0:b.q1], dk[:, :, b.k0:b.k1], dv[:, :, b.k0:b.k1],
                )
            compute_s += time.perf_counter() - start
            if incoming is not None:
                # the shares of ranks src .. rank - 1, sent by rank - 1 at the end of its last step
                start = time.perf_counter()
                dk_in, dv_in = incoming.wait()
                wait_s += time.perf_counter() - start
                dk += dk_in
                dv += dv_in
            if P > 1:
                # pass the accumulator of block src on; at the last step rank + 1 == src owns it.
                # Receive the one of the block held next (after the last step: this rank's own).
                n_next = plan.length(plan.source(step + 1))
                owner_note = "own " if step + 1 == P else ""
                incoming = ring.shift(
                    [dk, dv], [(N, G, n_next, E), (N, G, n_next, Ev)], [_TAG_DK, _TAG_DV],
                    f"backward step {step + 1}/{P}: {owner_note}dk/dv accumulator from rank {(ring.rank - 1) % P}",
                )
            if transfer is not None:
                start = time.perf_counter()
                k_cur, v_cur = transfer.wait()
                wait_s += time.perf_counter() - start
        if incoming is not None:
            start = time.perf_counter()
            dk, dv = incoming.wait()
            wait_s += time.perf_counter() - start
        if plan.stats is not None:
            plan.stats.backward_compute_s += compute_s
            plan.stats.backward_wait_s += wait_s
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _as_timedelta(timeout: float | timedelta | None) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be seconds (a number) or a datetime.timedelta, got {type(timeout).__name__}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"timeout must be a positive, finite duration, got {timeout!r}")
    return timedelta(seconds=seconds)


# What every rank must agree on, in the order of the exchanged metadata vector.
_AGREED = ("batch size N", "query heads H", "key/value heads G", "head dim E", "value head dim Ev",
           "dtype", "causal", "layout", "scale")


def _describe(field: str, value: float) -> str:
    if field == "dtype":
        return str(_DTYPES[int(value)]).removeprefix("torch.") if value >= 0 else "other"
    if field == "layout":
        return ("contiguous", "zigzag")[int(value)]
    if field == "causal":
        return str(bool(value))
    return f"{value:g}" if field == "scale" else str(int(value))


def _shard_lengths(ring: _Ring, local: list[float], layout: str, device: torch.device) -> list[int]:
    """Exchange the shapes and options of every rank; check they agree; return the shard lengths."""
    if ring.size == 1:
        lengths = [int(local[0])]
    else:
        mine = torch.tensor(local, dtype=torch.float64, device=device)  # where the backend wants q
        rows = [row.tolist() for row in ring.all_gather(mine, "exchanging shapes (all_gather)")]
        for i, field in enumerate(_AGREED, start=1):
            values = [row[i] for row in rows]
            if len(set(values)) > 1:
                seen = ", ".join(f"rank {r}: {_describe(field, x)}" for r, x in enumerate(values))
                raise ValueError(f"ring_attention: the ranks disagree on {field} ({seen})")
        lengths = [int(row[0]) for row in rows]
    seq_len = sum(lengths)
    expected = shard_lengths(seq_len, ring.size, layout)  # type: ignore[arg-type]
    if lengths != expected:
        raise ValueError(
            f"ring_attention: shard lengths {lengths} (rank order) are not the {layout!r} shards of a "
            f"{seq_len}-token sequence over {ring.size} ranks, which are {expected}; cut the sequence "
            f"with qkv.distributed.shard"
        )
    return lengths


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    layout: Layout = "contiguous",
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    timeout: float | timedelta | None = None,
    stats: RingStats | None = None,
) -> torch.Tensor:
    """Exact attention of a sequence sharded across the ranks of `group`.

    Every rank of the group calls this with its own shard, cut by `qkv.distributed.shard`
    with the same `layout`; the result is this rank's shard of
    ``qkv.attention(q_full, k_full, v_full, qkv.masks.causal() if causal else None)``.
    There is no attention dropout and no other mask.

    Args:
        q: (..., H, L_r, E) this rank's queries.
        k: (..., G, L_r, E) this rank's keys (self-attention: the same positions as q);
            H must be a multiple of G (grouped-query attention).
        v: (..., G, L_r, Ev) this rank's values.
        causal: mask of the full sequence: position p sees positions 0..p.
        layout: "contiguous" or "zigzag" (balances the causal work; see `layout`).
        group: the process group of the ring; None is the default group, or a lone rank
            without communication when torch.distributed is not initialised.
        scale: factor on q k^T; default 1 / sqrt(E).
        timeout: seconds (or timedelta) any one wait may last; default `DEFAULT_TIMEOUT`.
            The process group's own timeout should be of the same order.
        stats: a `RingStats` to add this rank's compute/wait times and work counters to.

    Returns:
        (..., H, L_r, Ev) in q's dtype, differentiable with respect to q, k and v.

    Raises:
        ValueError / TypeError for bad local inputs, before any communication; ValueError on
        every rank when the ranks disagree on shapes, dtype, options or shard lengths (found
        by one small all_gather); RingCommunicationError when a peer fails or times out.
        Uneven lengths are handled (see `qkv.distributed.layout`).

    Example (one rank, no process group):
        >>> import torch, qkv
        >>> x = torch.randn(1, 2, 6, 4)
        >>> out = ring_attention(x, x, x, causal=True)
        >>> torch.allclose(out, qkv.attention(x, x, x, qkv.masks.causal()), atol=1e-6)
        True
    """
    check_layout(layout)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if stats is not None and not isinstance(stats, RingStats):
        raise TypeError(f"stats must be a RingStats or None, got {type(stats).__name__}")
    problem = describe_problem(q, k, v, None, scale, 0.0)
    if problem.L != problem.S:
        raise ValueError(
            f"ring attention is self-attention over one sharded sequence: the q shard has {problem.L} "
            f"tokens but the k/v shard has {problem.S}"
        )
    ring = _Ring.create(group, _as_timedelta(timeout))
    code = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1
    local = [problem.L, problem.N, problem.H, problem.G, problem.E, problem.Ev, code, float(causal),
             float(layout == "zigzag"), problem.scale]
    start = time.perf_counter()
    lengths = _shard_lengths(ring, local, layout, q.device)
    if stats is not None:
        stats.forward_wait_s += time.perf_counter() - start
    seq_len = sum(lengths)
    chunks = tuple(shard_chunks(seq_len, r, ring.size, layout) for r in range(ring.size))
    plan = _Plan(ring, chunks, causal, problem.scale, stats)
    out = _RingAttention.apply(problem.q, problem.k, problem.v, plan)  # (N, H, L_r, Ev)
    return out.reshape(*problem.batch_shape, problem.H, problem.L, problem.Ev)  # (..., H, L_r, Ev)
