"""The decode benchmark behind `qkv bench --decode` and benchmarks/decode.py.

A decode step: B = 1, Hq = 32 query heads over G = 8 KV heads, E = 128 (a Llama-shaped layer),
one query against S cached keys, causal, the cache's running bounds passed as a model does
(`qkv.KVCache`). qkv.attention against SDPA (``enable_gqa=True``), both timed in rotating
rounds of one run (`fastest`). Bytes are those of K and V, the step's physical minimum (each
cached key and value read once); GB/s is those bytes over the time, beside the machine's read
bandwidth measured in the same rounds: ``torch.sum`` over a float32 buffer of `PROBE_BYTES`,
far beyond any cache level, whose bytes over its time are what one pass of reading memory
achieves with every intra-op thread.

`paged_steps` times the same step with the cache in a `qkv.PagedKVCache` of 16-position blocks:
one sequence alone (its blocks one run) and one of two sequences appended in turn (a run per
block, the fragmented pool of a server), against the contiguous `qkv.KVCache` and SDPA.

``softcap``: qkv's step caps its scores (Gemma 2, gpt-oss style); SDPA has no softcap, so its
column stays the uncapped step, the time a capped step would have to match.

`generation` times greedy generation with a random Llama-shaped transformers model
(``attn_implementation`` qkv vs sdpa): time to first token (the prompt's forward) and
tokens per second of the decode steps after it.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from qkv import masks
from qkv.attention.bounds import KVBounds
from qkv.native.timing import fastest

__all__ = [
    "PAGE", "PROBE_BYTES", "DecodeRow", "GenerationRow", "PagedRow", "decode_steps", "generation", "paged_steps",
    "read_bandwidth_probe",
]  # fmt: skip

H, G, E = 32, 8, 128
# The bandwidth probe's buffer: 512 MiB, beyond any CPU cache, larger than a 32k cache's K + V (268 MB).
PROBE_BYTES = 512 * 2**20


@dataclass(frozen=True)
class DecodeRow:
    """One decode step size: times in seconds, K + V bytes, and the probe's read bandwidth (B/s)."""

    S: int
    dtype: str
    qkv_seconds: float
    sdpa_seconds: float
    kv_bytes: int
    bandwidth: float
    path: str  # the path qkv.explain names for the step

    @property
    def ratio(self) -> float:
        """SDPA time / qkv time: above 1, qkv is faster."""
        return self.sdpa_seconds / self.qkv_seconds

    @property
    def qkv_rate(self) -> float:
        return self.kv_bytes / self.qkv_seconds

    @property
    def sdpa_rate(self) -> float:
        return self.kv_bytes / self.sdpa_seconds


def read_bandwidth_probe(nbytes: int = PROBE_BYTES) -> tuple[torch.Tensor, int]:
    """The probe's float32 buffer of ``nbytes`` and its size; time ``buffer.sum()`` with the rest."""
    buffer = torch.ones(nbytes // 4)
    return buffer, buffer.numel() * 4


def decode_steps(
    lengths: tuple[int, ...], dtypes: tuple[str, ...], reps: int, probe_bytes: int = PROBE_BYTES, softcap: float | None = None
) -> list[DecodeRow]:
    """The decode step at each cache length and dtype, qkv vs SDPA, with the read bandwidth."""
    from qkv.attention.functional import explain
    from qkv.nn.cache import KVCache

    causal = masks.causal()
    probe, probe_size = read_bandwidth_probe(probe_bytes)
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for S in lengths:
            gen = torch.Generator().manual_seed(S)
            k = torch.randn(1, G, S, E, generator=gen).to(dtype)  # (B, G, S, E)
            v = torch.randn(1, G, S, E, generator=gen).to(dtype)  # (B, G, S, Ev)
            q = torch.randn(1, H, 1, E, generator=gen).to(dtype)  # (B, H, 1, E)
            cache = KVCache(1, S, G, E, dtype=dtype)
            keys, values = cache.update(k, v)  # (1, G, S, E) views of the filled prefix
            del k, v
            with torch.inference_mode():
                times = fastest(_step_calls(q, keys, values, cache.bounds, probe, softcap), reps, warmup=1)
            path = explain(q, keys, values, causal, softcap=softcap).path
            kv_bytes = (keys.numel() + values.numel()) * keys.element_size()
            rows.append(DecodeRow(S, dtype_name, times["qkv"], times["sdpa"], kv_bytes, probe_size / times["probe"], path))
    return rows


def _step_calls(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bounds: KVBounds, probe: torch.Tensor,
    softcap: float | None = None,
) -> dict[str, Callable[[], object]]:
    """The timed calls of one size: the bandwidth probe, qkv's step (with ``softcap``) and SDPA's (none)."""
    from qkv.attention.functional import attention

    causal = masks.causal()
    return {
        "probe": lambda: probe.sum(),
        "qkv": lambda: attention(q, keys, values, causal, kv_bounds=bounds, softcap=softcap),
        "sdpa": lambda: F.scaled_dot_product_attention(q, keys, values, enable_gqa=True),
    }


# Positions per block of the paged cache (vLLM's default)
PAGE = 16


@dataclass(frozen=True)
class PagedRow:
    """One decode step over a paged cache: seconds of the contiguous cache's step, the paged
    step with the sequence in one run and in a fragmented pool, and SDPA."""

    S: int
    dtype: str
    contiguous_seconds: float
    paged_seconds: float
    fragmented_seconds: float
    sdpa_seconds: float


def paged_steps(
    lengths: tuple[int, ...], dtypes: tuple[str, ...], reps: int, softcap: float | None = None
) -> list[PagedRow]:
    """`PagedKVCache.attend` for one decode step at each length and dtype, beside the contiguous
    cache's `qkv.attention` and SDPA on the same keys (qkv's steps with ``softcap``, SDPA's without)."""
    return [_paged_row(S, dtype_name, reps, softcap) for dtype_name in dtypes for S in lengths]


def _paged_row(S: int, dtype_name: str, reps: int, softcap: float | None) -> PagedRow:
    from qkv.attention.functional import attention
    from qkv.nn.cache import KVCache
    from qkv.nn.paged_cache import PagedKVCache

    causal = masks.causal()
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(S)
    k = torch.randn(G, S, E, generator=gen).to(dtype)  # (G, S, E)
    v = torch.randn(G, S, E, generator=gen).to(dtype)  # (G, S, Ev)
    q = torch.randn(H, 1, E, generator=gen).to(dtype)  # (H, 1, E)
    cache = KVCache(1, S, G, E, dtype=dtype)
    keys, values = cache.update(k[None], v[None])  # (1, G, S, E)
    alone = PagedKVCache(S // PAGE + 1, PAGE, G, E, dtype=dtype)
    one = alone.allocate()
    alone.append([one], [k], [v])
    pool = PagedKVCache(2 * (S // PAGE) + 2, PAGE, G, E, dtype=dtype)
    ids = [pool.allocate(), pool.allocate()]
    for first in range(0, S, PAGE):  # the two sequences take blocks in turn
        part_k, part_v = k[:, first : first + PAGE], v[:, first : first + PAGE]  # (G, PAGE, E)
        pool.append(ids, [part_k, part_k], [part_v, part_v])
    calls = {
        "contiguous": lambda: attention(q[None], keys, values, causal, kv_bounds=cache.bounds, softcap=softcap),
        "paged": lambda: alone.attend([one], [q], causal, softcap=softcap),
        "fragmented": lambda: pool.attend(ids[:1], [q], causal, softcap=softcap),
        "sdpa": lambda: F.scaled_dot_product_attention(q[None], keys, values, enable_gqa=True),
    }
    with torch.inference_mode():
        times = fastest(calls, reps, warmup=1)
    return PagedRow(S, dtype_name, times["contiguous"], times["paged"], times["fragmented"], times["sdpa"])


@dataclass(frozen=True)
class GenerationRow:
    """Greedy generation with one attention implementation: prompt tokens, time to first token
    (seconds) and decode tokens per second after it."""

    implementation: str
    cache: str  # "dynamic" (transformers' DynamicCache) or "growing" (`growing_cache`)
    prompt: int
    new_tokens: int
    first_token_seconds: float
    tokens_per_second: float


GENERATION_CACHES = ("dynamic", "growing")


def generation(
    prompt: int, new_tokens: int, layers: int = 4, hidden: int = 2048, head_dim: int = 128, seed: int = 0,
    caches: tuple[str, ...] = ("dynamic",),
) -> list[GenerationRow]:
    """Greedy generation with a random Llama-shaped model (``layers``, ``hidden``, 32 / 8
    heads of ``head_dim``), qkv's transformers backend vs sdpa, float32, one batch row, with
    each of ``caches`` (`GENERATION_CACHES`: transformers' DynamicCache, which copies the whole
    cache at every step, or `qkv.integrations.transformers.growing_cache`), the same for both."""
    unknown = [c for c in caches if c not in GENERATION_CACHES]
    if unknown or not caches:
        raise ValueError(f"generation: caches must be some of {', '.join(GENERATION_CACHES)}, got {list(caches)}")
    import transformers

    from qkv.integrations.transformers import register

    name = register()
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=head_dim, max_position_embeddings=prompt + new_tokens + 1,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(seed))
    rows = []
    for cache in caches:
        for implementation in (name, "sdpa"):
            model.set_attn_implementation(implementation)
            first, rate = _greedy(model, ids, new_tokens, cache)
            rows.append(GenerationRow(implementation, cache, prompt, new_tokens, first, rate))
    return rows


def _greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, cache: str) -> tuple[float, float]:
    """Greedy decoding by hand, so that its two phases are timed apart: (seconds of the prompt's
    forward up to the first token, tokens per second of the ``new_tokens`` steps after it)."""
    import transformers

    # transformers >= 5.2x names the cache argument ``cache``; earlier versions ``past_key_values``
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    from qkv.integrations.transformers import growing_cache

    config: Any = model.config  # a transformers model's config
    store = growing_cache(config) if cache == "growing" else transformers.DynamicCache(config=config)
    cached = {name: store, "use_cache": True}
    with torch.inference_mode():
        start = time.perf_counter()
        logits = model(ids, logits_to_keep=1, **cached).logits  # (1, 1, vocab)
        token = logits[:, -1:].argmax(-1)  # (1, 1)
        first = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(new_tokens):
            logits = model(token, **cached).logits  # (1, 1, vocab)
            token = logits[:, -1:].argmax(-1)  # (1, 1)
        steps = time.perf_counter() - start
    return first, new_tokens / steps
