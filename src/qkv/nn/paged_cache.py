"""`PagedKVCache`: keys and values of many sequences of different lengths in one pool of blocks.

A contiguous `qkv.KVCache` reserves ``max_len`` positions for every sequence. A paged cache
(vLLM's PagedAttention, FlashAttention's ``flash_attn_with_kvcache(..., block_table=...)``)
cuts storage into fixed-size blocks of ``block_size`` positions shared by all sequences; a
sequence takes a block when its last one is full and gives all of them back when freed.

Its *block table* lists the physical blocks of a sequence in order: position t of sequence b
lives at ``k[block_table[b, t // block_size], t % block_size]``. `block_table(ids)` returns
them as FlashAttention and vLLM take them, (B, max_blocks) int32 (entries past a sequence's
own blocks are 0 and never read), with `cache_seqlens(ids)` (B,) int32; ``k`` and ``v`` have
FlashAttention's paged layout (num_blocks, block_size, G, E), so the three can be passed to
`qkv.compat.flash_attn_with_kvcache` as they are.

`attend` runs a decode step (what `qkv.attention` sends to its decode path: L <= 16 queries,
S >= 1,024 keys, on CPU) over the blocks where they lie (`qkv.backends.decode.decode_blocks`),
so no block is copied: the compiled decode kernel reads them through the sequence's block table,
however fragmented the pool, bit for bit a contiguous `KVCache`'s result. Where it does not run
(a bias, a gradient, no compiler), each run of consecutive physical blocks is a strided view,
split into chunks whose softmax states merge by lse, and in a fragmented pool (many short runs)
the whole blocks every query sees go to the fused kernel in spans of the pool (only while every
value in the pool is finite and no score over it can overflow: the spans read other sequences'
blocks under a -inf mask, which a NaN survives): a contiguous cache's result to rounding (bit for bit when the sequence is one run). Any other call gathers the sequence's blocks into (G, S, E) and runs
`qkv.attention`, bit for bit a contiguous cache's result. Like `KVCache` it keeps a running
max |k| and |v| per sequence, so the input checks read the queries only (`qkv.attention.bounds`);
a write to the pool by other means (``cache.k[block] = x``, or `flash_attn_with_kvcache` given
the pool with new keys) moves the pool's version counter past the one `append` left, and the
next `append` or `attend` bounds every sequence afresh from its blocks (inference tensors keep
no counter: under ``torch.inference_mode`` such a write goes unseen).

Every method checks all of its arguments (known sequence ids, shapes, dtypes, enough free
blocks for the whole batch) before it changes anything. Use under ``torch.no_grad()`` or
``torch.inference_mode()``: storage is written in place.

Shape legend (docs/design.md): G key/value heads, H query heads, L new positions, S positions held,
E key dim, Ev value dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from qkv._checks import positive_int
from qkv.attention.bounds import KVBounds, largest_magnitude
from qkv.attention.dispatch import DECODE_MIN_KEYS, choose_path
from qkv.attention.functional import attention
from qkv.attention.problem import describe_problem
from qkv.backends import decode
from qkv.backends.decode import block_runs, decode_blocks
from qkv.backends.softmax import accumulation_dtype
from qkv.masks import Mask
from qkv.nn.cache import storage_heads

__all__ = ["PagedKVCache"]


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)  # physical blocks, in position order
    length: int = 0  # positions 0 .. length - 1 hold keys and values
    k_max: float = 0.0  # >= max |k| written to this sequence (inf: a non-finite k)
    v_max: float = 0.0


class PagedKVCache:
    """Keys (num_blocks, block_size, G, E) and values (num_blocks, block_size, G, Ev) in blocks.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: positions per block.
        num_kv_heads: G.
        d_k: E, key width per head.
        d_v: Ev, value width per head (default d_k).
        dtype, device: of the storage; keys and values written must match them.

    Example: two sequences of different lengths, then one decoding step for both:
        >>> import qkv
        >>> cache = PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=1, d_k=2)
        >>> a, b = cache.allocate(), cache.allocate()
        >>> cache.append([a, b], [torch.randn(1, 6, 2), torch.randn(1, 3, 2)], [torch.randn(1, 6, 2), torch.randn(1, 3, 2)])
        >>> cache.append([a, b], [torch.randn(1, 1, 2)] * 2, [torch.randn(1, 1, 2)] * 2)
        >>> cache.cache_seqlens([a, b]).tolist(), cache.block_table([a, b]).tolist(), cache.free_blocks
        ([7, 4], [[0, 1], [2, 0]], 5)
        >>> out = cache.attend([a, b], [torch.randn(2, 1, 2)] * 2, qkv.masks.causal())  # H = 2
        >>> [tuple(o.shape) for o in out]
        [(2, 1, 2), (2, 1, 2)]
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        d_k: int,
        d_v: int | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        N = positive_int(num_blocks, "PagedKVCache: num_blocks")
        P = positive_int(block_size, "PagedKVCache: block_size")
        G, E, Ev = storage_heads("PagedKVCache", num_kv_heads, d_k, d_v, dtype)
        self.k = torch.zeros(N, P, G, E, dtype=dtype, device=device)  # (num_blocks, block_size, G, E)
        self.v = torch.zeros(N, P, G, Ev, dtype=dtype, device=device)  # (num_blocks, block_size, G, Ev)
        self._free = list(range(N - 1, -1, -1))  # a stack: the lowest free block is taken first
        self._sequences: dict[int, _Sequence] = {}
        self._next_id = 0
        self._versions = self._pool_versions()  # the pool as this cache last wrote it
        # running max |k| and |v| over the whole pool, freed blocks included (their old values
        # stay): the fallback's spans read other sequences' blocks under a -inf mask, which
        # hides a finite score but not a NaN or inf value, nor a score that overflows
        self._pool_k_max = self._pool_v_max = 0.0

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def __repr__(self) -> str:
        N, P, G, E = self.k.shape
        return (
            f"PagedKVCache(sequences={len(self._sequences)}, free_blocks={self.free_blocks}/{N}, block_size={P}, "
            f"num_kv_heads={G}, d_k={E}, d_v={self.v.shape[-1]}, dtype={self.k.dtype}, device={self.k.device})"
        )

    def allocate(self) -> int:
        """A new empty sequence; its id. Blocks are taken as positions are appended."""
        seq_id = self._next_id
        self._next_id += 1
        self._sequences[seq_id] = _Sequence()
        return seq_id

    def free(self, seq_id: int) -> None:
        """Forget a sequence and give its blocks back to the pool."""
        state = self._sequence(seq_id, "free")
        del self._sequences[seq_id]
        self._free.extend(reversed(state.blocks))

    def length(self, seq_id: int) -> int:
        """The positions sequence ``seq_id`` holds."""
        return self._sequence(seq_id, "length").length

    def cache_seqlens(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """(B,) int32: the positions each sequence holds (FlashAttention's ``cache_seqlens``)."""
        states = self._sequences_of(seq_ids, "cache_seqlens")
        return torch.tensor([s.length for s in states], dtype=torch.int32, device=self.k.device)

    def block_table(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """(B, max_blocks) int32: row b lists the physical blocks of seq_ids[b] in order, then 0s."""
        states = self._sequences_of(seq_ids, "block_table")
        width = max(1, *(len(s.blocks) for s in states))
        rows = [s.blocks + [0] * (width - len(s.blocks)) for s in states]
        return torch.tensor(rows, dtype=torch.int32, device=self.k.device)  # (B, max_blocks)

    def append(self, seq_ids: Sequence[int], keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Append keys[i] (G, L_i, E) and values[i] (G, L_i, Ev) to sequence seq_ids[i]; L_i may differ.

        Raises before writing anything when an id is unknown or repeated, a shape or dtype does
        not match, or the free blocks do not suffice for the whole batch.
        """
        states = self._sequences_of(seq_ids, "append")
        if len(keys) != len(states) or len(values) != len(states):
            raise ValueError(
                f"PagedKVCache.append: {len(states)} sequence ids need as many keys and values, "
                f"got {len(keys)} keys and {len(values)} values"
            )
        _, _, G, E = self.k.shape
        Ev = self.v.shape[-1]
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            for name, new, store, width in (("keys", k, self.k, E), ("values", v, self.v, Ev)):
                if not isinstance(new, torch.Tensor):
                    raise TypeError(f"PagedKVCache.append: {name}[{i}] must be a torch.Tensor, got {type(new).__name__}")
                if new.ndim != 3 or new.shape[0] != G or new.shape[2] != width:
                    raise ValueError(f"PagedKVCache.append: {name}[{i}] must have shape ({G}, L, {width}), got {tuple(new.shape)}")
                if new.dtype != store.dtype or new.device != store.device:
                    raise TypeError(
                        f"PagedKVCache.append: {name}[{i}] is {new.dtype} on {new.device} but the cache stores "
                        f"{store.dtype} on {store.device}"
                    )
            if k.shape[1] != v.shape[1]:
                raise ValueError(f"PagedKVCache.append: keys[{i}] and values[{i}] have lengths {k.shape[1]} and {v.shape[1]}")
        needed = [self._blocks_for(s.length + k.shape[1]) - len(s.blocks) for s, k in zip(states, keys, strict=True)]
        if sum(needed) > self.free_blocks:
            raise ValueError(
                f"PagedKVCache.append: out of blocks: the batch needs {sum(needed)} new blocks of {self.block_size} "
                f"positions and {self.free_blocks} of {self.num_blocks} are free; free finished sequences or make a "
                "larger cache"
            )
        self._rescan_if_written()
        for state, k, v, n in zip(states, keys, values, needed, strict=True):
            state.blocks.extend(self._free.pop() for _ in range(n))
            block, offset = self._slots(state, state.length, k.shape[1])  # (L,), (L,)
            self.k[block, offset] = k.transpose(0, 1)  # (L, G, E) into (L, G, E) slots
            self.v[block, offset] = v.transpose(0, 1)  # (L, G, Ev)
            state.length += k.shape[1]
            k_max, v_max = largest_magnitude(k), largest_magnitude(v)  # O(new rows)
            state.k_max, state.v_max = max(state.k_max, k_max), max(state.v_max, v_max)
            self._pool_k_max, self._pool_v_max = max(self._pool_k_max, k_max), max(self._pool_v_max, v_max)
        self._versions = self._pool_versions()

    def _pool_versions(self) -> tuple[int, int] | None:
        """The pool's version counters (None for inference tensors, which keep none)."""
        if self.k.is_inference() or self.v.is_inference():
            return None
        return self.k._version, self.v._version

    def _rescan_if_written(self) -> None:
        """Bound every sequence afresh from its blocks when the pool was written since this
        cache's last write: the running maxima never saw what was written by other means."""
        versions = self._pool_versions()
        if versions is None or versions == self._versions:
            return
        for state in self._sequences.values():
            runs = block_runs(self.k, self.v, state.blocks, state.length)  # views, nothing copied
            state.k_max = max((largest_magnitude(k) for _, k, _ in runs), default=0.0)
            state.v_max = max((largest_magnitude(v) for _, _, v in runs), default=0.0)
        self._pool_k_max, self._pool_v_max = largest_magnitude(self.k), largest_magnitude(self.v)
        self._versions = versions

    def keys_values(self, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``seq_id``'s keys (G, S, E) and values (G, S, Ev), gathered from its blocks (a copy)."""
        state = self._sequence(seq_id, "keys_values")
        S, G = state.length, self.k.shape[2]
        blocks = torch.tensor(state.blocks, dtype=torch.long, device=self.k.device)  # (n,)
        k = self.k[blocks].reshape(-1, G, self.k.shape[-1])[:S]  # (n * block_size, G, E) -> (S, G, E)
        v = self.v[blocks].reshape(-1, G, self.v.shape[-1])[:S]  # (S, G, Ev)
        return k.transpose(0, 1), v.transpose(0, 1)  # (G, S, E), (G, S, Ev)

    def attend(
        self,
        seq_ids: Sequence[int],
        queries: Sequence[torch.Tensor],
        mask: Mask | None = None,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """queries[i] (H, L_i, E) attend to everything sequence seq_ids[i] holds; one (H, L_i, Ev) each.

        ``mask`` is None or a `qkv.masks` object applied to each sequence with its own L_i and
        S_i: ``qkv.masks.causal()`` aligns bottom-right, so new queries (appended first) see the
        whole history and each other up to themselves. H must be a multiple of G (GQA).
        ``scale``, ``softcap`` and ``sinks`` (H,) are `qkv.attention`'s, the same for every sequence.
        """
        states = self._sequences_of(seq_ids, "attend")
        if len(queries) != len(states):
            raise ValueError(f"PagedKVCache.attend: {len(states)} sequence ids need as many queries, got {len(queries)}")
        if mask is not None and not isinstance(mask, Mask):
            raise TypeError(f"PagedKVCache.attend: mask must be None or a qkv.masks object, got {type(mask).__name__}")
        _, _, G, E = self.k.shape
        for i, (state, q) in enumerate(zip(states, queries, strict=True)):
            if not isinstance(q, torch.Tensor):
                raise TypeError(f"PagedKVCache.attend: queries[{i}] must be a torch.Tensor, got {type(q).__name__}")
            if q.ndim != 3 or q.shape[2] != E or q.shape[0] % G != 0:
                raise ValueError(
                    f"PagedKVCache.attend: queries[{i}] must have shape (H, L, {E}) with H a multiple of "
                    f"G={G}, got {tuple(q.shape)}"
                )
            if q.dtype != self.k.dtype or q.device != self.k.device:
                raise TypeError(
                    f"PagedKVCache.attend: queries[{i}] is {q.dtype} on {q.device} but the cache stores "
                    f"{self.k.dtype} on {self.k.device}"
                )
            if state.length == 0:
                raise ValueError(f"PagedKVCache.attend: sequence {seq_ids[i]} holds no keys yet; append first")
        self._rescan_if_written()
        outputs = []
        for seq_id, state, q in zip(seq_ids, states, queries, strict=True):
            step = self._attend_in_place(state, q, mask, scale, softcap, sinks)
            if step is not None:
                outputs.append(step)
                continue
            k, v = self.keys_values(seq_id)  # (G, S, E), (G, S, Ev)
            k, v = k[None], v[None]  # (1, G, S, E), (1, G, S, Ev)
            known = KVBounds.of(k, v, state.k_max, state.v_max)  # fresh copies: the running maxima hold
            out = attention(q[None], k, v, mask, scale=scale, softcap=softcap, sinks=sinks, kv_bounds=known)  # (1, H, L, Ev)
            assert isinstance(out, torch.Tensor)
            outputs.append(out[0])  # (H, L, Ev)
        return outputs

    def runs(self, seq_id: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Sequence ``seq_id``'s keys and values where they lie, without copying: one
        (first position, k (1, G, n, E), v (1, G, n, Ev)) per run of consecutive physical blocks,
        strided views of the pool (`qkv.backends.decode.decode_runs` takes them)."""
        state = self._sequence(seq_id, "runs")
        return block_runs(self.k, self.v, state.blocks, state.length)

    def _attend_in_place(
        self, state: _Sequence, q: torch.Tensor, mask: Mask | None, scale: float | None, softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """One sequence's step on the decode kernel over its block runs, nothing gathered; None
        when `qkv.attention` would not take the decode path for the same keys in one piece (then
        the caller gathers). Same checks as `qkv.attention`, on a stand-in of the right shape
        with no storage (stride 0) whose data checks the running bounds replace."""
        G, E, Ev, S = self.k.shape[2], self.k.shape[3], self.v.shape[3], state.length
        if q.device.type != "cpu" or q.shape[1] > decode.MAX_QUERIES or S < DECODE_MIN_KEYS:
            return None  # not a decode step (`choose_path` decides the rest)
        if not (math.isfinite(state.k_max) and math.isfinite(state.v_max)):
            return None  # the NaN rule needs the data: the gathered path applies it
        k_like = self.k[0, 0][None, :, None, :].expand(1, G, S, E)  # (1, G, S, E), stride 0 along S
        v_like = self.v[0, 0][None, :, None, :].expand(1, G, S, Ev)  # (1, G, S, Ev)
        factor = max(1.0, abs(1.0 / math.sqrt(E) if scale is None else float(scale)))
        limit, q_max = torch.finfo(accumulation_dtype(q.dtype)).max / 2, largest_magnitude(q)
        if factor * E * q_max * state.k_max > limit:
            return None  # the overflow check would read k's rows for its tight bound: gather
        # spans of the pool (a fragmented pool without the compiled kernel) read other sequences'
        # blocks hidden by the mask: only while every value in the pool is finite and no score
        # there can overflow (a NaN or an infinite score would survive the -inf it gets)
        spans = math.isfinite(self._pool_v_max) and factor * E * q_max * self._pool_k_max <= limit
        known = KVBounds.of(k_like, v_like, state.k_max, state.v_max)
        problem = describe_problem(q[None], k_like, v_like, mask, scale, softcap=softcap, kv_bounds=known, sinks=sinks)
        if problem.nonfinite or choose_path(problem, "auto", False, False).path != "decode":
            return None
        assert problem.mask is None or isinstance(problem.mask, Mask)
        out, _ = decode_blocks(problem.q, self.k, self.v, state.blocks, S, problem.scale,
                             None if problem.mask is None else problem.mask.to(q.device), problem.terms,
                             problem.sinks, spans=spans)  # fmt: skip
        return out[0]  # (H, L, Ev)

    def _blocks_for(self, length: int) -> int:
        return math.ceil(length / self.block_size)

    def _slots(self, state: _Sequence, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Physical block and offset of positions start .. start + count - 1 of a sequence."""
        device = self.k.device
        positions = torch.arange(start, start + count, device=device)  # (L,)
        table = torch.tensor(state.blocks, dtype=torch.long, device=device)  # (n,)
        return table[positions // self.block_size], positions % self.block_size

    def _sequence(self, seq_id: object, method: str) -> _Sequence:
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id not in self._sequences:
            known = sorted(self._sequences)
            raise ValueError(f"PagedKVCache.{method}: unknown sequence id {seq_id!r} (allocated and not freed: {known})")
        return self._sequences[seq_id]

    def _sequences_of(self, seq_ids: Sequence[int], method: str) -> list[_Sequence]:
        if isinstance(seq_ids, (int, str, bytes)) or not isinstance(seq_ids, Sequence):
            raise TypeError(f"PagedKVCache.{method}: seq_ids must be a sequence of ids, got {type(seq_ids).__name__}")
        if len(seq_ids) == 0:
            raise ValueError(f"PagedKVCache.{method}: seq_ids is empty")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"PagedKVCache.{method}: seq_ids repeats an id: {list(seq_ids)}")
        return [self._sequence(i, method) for i in seq_ids]
