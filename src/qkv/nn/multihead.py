"""`MultiHeadAttention`: the module people put in their models, on top of `qkv.attention`.

The seeds' second article: H heads, each with its own W_Q, W_K, W_V in a smaller subspace,
their outputs concatenated and mixed by W_O::

    head_h = Attention(X W_Q^h, C W_K^g, C W_V^g)       g = h // (H / G)
    output = concat(head_1, ..., head_H) W_O

C is X for self-attention, another sequence (the context) for cross-attention. G = H is
classic multi-head attention, G = 1 multi-query attention (MQA), anything between grouped-query
attention (GQA): several query heads share one key/value head, which shrinks the KV cache.

The per-head matrices live side by side in four `nn.Linear` layers, ``q_proj`` (D -> H*E),
``k_proj`` (Dc -> G*E), ``v_proj`` (Dc -> G*Ev), ``out_proj`` (H*Ev -> D); head h owns output
features [h*E, (h+1)*E) of ``q_proj``, so BERT-style checkpoints copy in unchanged.

Shape legend (docs/design.md): B batch, H query heads, G key/value heads, L query length, S key
length, E q/k head dim (d_k), Ev value head dim (d_v), D model width, Dc context width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import nn

from qkv._checks import positive_int
from qkv.attention.functional import attention
from qkv.attention.problem import autocast_dtype, normalize_mask
from qkv.bias import Bias
from qkv.masks import Mask
from qkv.native import onednn_linear
from qkv.native.machine import compute_dtype, note_computed_wide
from qkv.nn.cache import KVCache
from qkv.nn.positional import RotaryEmbedding
from qkv.scores import check_softcap

__all__ = ["MultiHeadAttention", "MultiHeadConfig"]


@dataclass(frozen=True)
class MultiHeadConfig:
    """The sizes of a `MultiHeadAttention`, defaults resolved."""

    d_model: int  # D, width of x and of the output
    num_heads: int  # H query heads
    d_k: int  # E, query/key width per head (default D / H)
    d_v: int  # Ev, value width per head (default D / H)
    num_kv_heads: int  # G key/value heads, H % G == 0 (G == H: multi-head, G == 1: multi-query)
    d_context: int  # Dc, width of the context in cross-attention (default D)
    bias: bool = True  # every projection has a bias
    dropout: float = 0.0  # probability of dropping an attention weight, training mode only
    batch_first: bool = True  # x is (B, L, D); False: (L, B, D), nn.MultiheadAttention's default


# Fuse the q, k, v projections of self-attention when B * L >= this times d_model. Measured on
# CPU (D = 512, forward and forward + backward): separate products win up to about D rows
# (decoding steps, where copying the weights costs more than the product), the fused one is
# 1.5x faster at 8 * D rows.
_FUSE_ROWS_PER_WIDTH = 1



def _resolve_config(
    d_model: int,
    num_heads: int,
    d_k: int | None,
    d_v: int | None,
    num_kv_heads: int | None,
    d_context: int | None,
    bias: bool,
    dropout: float,
    batch_first: bool = True,
) -> MultiHeadConfig:
    D = positive_int(d_model, "MultiHeadAttention: d_model")
    H = positive_int(num_heads, "MultiHeadAttention: num_heads")
    if (d_k is None or d_v is None) and D % H != 0:
        raise ValueError(
            f"MultiHeadAttention: d_model={D} is not divisible by num_heads={H}; "
            "pass d_k and d_v (the per-head widths) explicitly"
        )
    E = D // H if d_k is None else positive_int(d_k, "MultiHeadAttention: d_k")
    Ev = D // H if d_v is None else positive_int(d_v, "MultiHeadAttention: d_v")
    G = H if num_kv_heads is None else positive_int(num_kv_heads, "MultiHeadAttention: num_kv_heads")
    if H % G != 0:
        raise ValueError(
            f"MultiHeadAttention: num_heads={H} must be a multiple of num_kv_heads={G} (grouped-query attention)"
        )
    Dc = D if d_context is None else positive_int(d_context, "MultiHeadAttention: d_context")
    if not isinstance(bias, bool):
        raise TypeError(f"MultiHeadAttention: bias must be a bool, got {bias!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"MultiHeadAttention: dropout must be a probability in [0, 1), got {dropout!r}")
    if not isinstance(batch_first, bool):
        raise TypeError(f"MultiHeadAttention: batch_first must be a bool, got {batch_first!r}")
    return MultiHeadConfig(D, H, E, Ev, G, Dc, bias, float(dropout), batch_first)


def _own_position_bias(module: nn.Module, position_bias: object, H: int) -> Bias | None:
    """Check the position bias and register its tensors on ``module`` (parameters stay
    parameters, other tensors become buffers) as position_bias_0, position_bias_1, ..."""
    names: list[str] = []
    module._position_bias_names = names  # type: ignore[assignment]
    if position_bias is None:
        return None
    if not isinstance(position_bias, Bias):
        raise TypeError(
            f"MultiHeadAttention: position_bias must be a qkv.bias object (alibi(), relative(table)), "
            f"got {type(position_bias).__name__}"
        )
    if position_bias.heads not in (None, H):
        raise ValueError(f"MultiHeadAttention: {position_bias.describe()} does not fit num_heads={H}")
    for i, tensor in enumerate(position_bias.tensors()):
        name = f"position_bias_{i}"
        if isinstance(tensor, nn.Parameter):
            module.register_parameter(name, tensor)
        else:
            module.register_buffer(name, tensor)
        names.append(name)
    return position_bias


class MultiHeadAttention(nn.Module):
    """Multi-head self- or cross-attention with GQA, RoPE and a KV cache.

    Args:
        d_model: D, width of the input x and of the output.
        num_heads: H query heads.
        d_k: E, query/key width per head; default d_model // num_heads.
        d_v: Ev, value width per head; default d_model // num_heads.
        num_kv_heads: G key/value heads (GQA; 1 is MQA); default num_heads.
        d_context: Dc, width of the context in cross-attention; default d_model.
        bias: whether the four projections have biases.
        dropout: attention-weight dropout, applied in training mode only.
        rope: a `qkv.nn.positional.RotaryEmbedding` with head_dim == d_k, applied to queries and
            keys (self-attention only); None for none.
        batch_first: True (default): x (B, L, D), context (B, S, Dc) and the output (B, L, D).
            False: x (L, B, D), context (S, B, Dc), output (L, B, D), the layout of
            ``nn.MultiheadAttention(batch_first=False)``. Masks, weights and caches keep their
            (B, H, L, S) / (B, G, S, E) layout either way.
        position_bias: a `qkv.bias` object added to every score: ``qkv.bias.alibi()`` (the
            paper's slopes for num_heads) or ``alibi(slopes)``, ``qkv.bias.relative(table)``
            (T5). Its tensors become the module's: an ``nn.Parameter`` (a learnable table)
            is registered as a parameter, any other tensor as a buffer, so they follow
            ``.to()`` and ``state_dict()``. Positions are bottom-right, so with a KV cache a
            step's queries continue from the cached length.
        softcap: cap the scores at +-softcap (Gemma 2's attention softcap); None for none.

    Inputs must have the dtype of the weights (``module.to(dtype)`` converts the layer);
    another dtype is refused with a TypeError rather than cast silently. A bfloat16 layer on
    a CPU without native bf16 products (no AVX-512 BF16 / AMX, `qkv.native.machine`) keeps
    bf16 weights, inputs and outputs but computes in float32 from the first product to the
    last, with float32 copies of its weights kept between calls (twice the bf16 weights'
    memory; rebuilt when a weight changes in place or is replaced, not after writes through
    ``p.data``: see `qkv.native.onednn_linear.wide_copy`).

    Parameters: ``q_proj`` (D -> H*E), ``k_proj`` (Dc -> G*E), ``v_proj`` (Dc -> G*Ev),
    ``out_proj`` (H*Ev -> D), all `nn.Linear`.

    Example:
        >>> import torch, qkv
        >>> mha = qkv.MultiHeadAttention(16, 4, num_kv_heads=2)
        >>> x = torch.randn(2, 5, 16)
        >>> out, weights = mha(x, mask=qkv.masks.causal(), return_weights=True)
        >>> tuple(out.shape), tuple(weights.shape)
        ((2, 5, 16), (2, 4, 5, 5))

    With ALiBi, or a learnable T5 table (32 buckets per head):

        >>> alibi_layer = qkv.MultiHeadAttention(16, 4, position_bias=qkv.bias.alibi())
        >>> table = torch.nn.Parameter(torch.zeros(4, 32))
        >>> t5_layer = qkv.MultiHeadAttention(16, 4, position_bias=qkv.bias.relative(table))
        >>> [name for name, _ in t5_layer.named_parameters()][0], tuple(t5_layer(x).shape)
        ('position_bias_0', (2, 5, 16))
    """

    _position_bias_names: list[str]  # set by _own_position_bias: the names of its registered tensors

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        d_k: int | None = None,
        d_v: int | None = None,
        num_kv_heads: int | None = None,
        d_context: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        rope: RotaryEmbedding | None = None,
        batch_first: bool = True,
        position_bias: Bias | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        cfg = _resolve_config(d_model, num_heads, d_k, d_v, num_kv_heads, d_context, bias, dropout, batch_first)
        if rope is not None:
            if not isinstance(rope, RotaryEmbedding):
                raise TypeError(f"MultiHeadAttention: rope must be a qkv.nn.positional.RotaryEmbedding or None, got {type(rope).__name__}")
            if rope.head_dim != cfg.d_k:
                raise ValueError(f"MultiHeadAttention: rope.head_dim={rope.head_dim} must equal d_k={cfg.d_k}")
        self.config = cfg
        H, G, E, Ev = cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
        self.q_proj = nn.Linear(cfg.d_model, H * E, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.d_context, G * E, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.d_context, G * Ev, bias=cfg.bias)
        self.out_proj = nn.Linear(H * Ev, cfg.d_model, bias=cfg.bias)
        self.rope = rope
        self.softcap = check_softcap(softcap)
        self.position_bias = _own_position_bias(self, position_bias, H)

    def _position_bias(self) -> Bias | None:
        """The position bias reading the module's current tensors (they may have been moved)."""
        if self.position_bias is None:
            return None
        names = self._position_bias_names
        return self.position_bias.with_tensors(tuple(getattr(self, name) for name in names))

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """A qkv module with ``module``'s weights, dtype, device, dropout and mode.

        It computes the same outputs: ``theirs(x, x, x, need_weights=False)[0] == ours(x)``
        and ``theirs(x, c, c, need_weights=False)[0] == ours(x, c)``. It has
        ``module.batch_first``: PyTorch's default batch_first=False gives a module that takes
        and returns (L, B, D) tensors. `qkv.nn.interop.masks_from_torch` converts its masks.

        PyTorch's weights: with kdim == vdim == embed_dim the q, k, v projections are packed
        in ``in_proj_weight`` (3D, D) as rows [W_q; W_k; W_v], otherwise they are separate
        ``q_proj_weight`` (D, D), ``k_proj_weight`` (D, kdim), ``v_proj_weight`` (D, vdim); the
        bias is always packed in ``in_proj_bias`` (3D,). Head h owns rows [h*D/H, (h+1)*D/H)
        of each, as in qkv's projections.

        What differs: PyTorch averages the weights over heads by default (B, L, S), qkv returns
        them per head (B, H, L, S) (``weights.mean(dim=1)`` gives PyTorch's); a query row whose
        keys are all masked is NaN in PyTorch (need_weights=True and its inference path) and
        gets ``out_proj``'s bias here (attention output zeros, docs/design.md).

        Raises:
            TypeError: ``module`` is not an `nn.MultiheadAttention`.
            ValueError: what qkv cannot reproduce: ``add_bias_kv`` or ``add_zero_attn`` (extra
                learned / zero key positions), ``kdim != vdim`` (qkv reads keys and values
                from one context), a bias on the input projections but not the output one.
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"from_torch takes a torch.nn.MultiheadAttention, got {type(module).__name__}")
        if module.bias_k is not None or module.bias_v is not None:
            raise ValueError("from_torch: nn.MultiheadAttention(add_bias_kv=True) is not supported by qkv")
        if module.add_zero_attn:
            raise ValueError("from_torch: nn.MultiheadAttention(add_zero_attn=True) is not supported by qkv")
        if module.kdim != module.vdim:
            raise ValueError(
                f"from_torch: kdim={module.kdim} != vdim={module.vdim}; qkv reads keys and values from "
                "one context, so their widths must be equal"
            )
        if module._qkv_same_embed_dim:
            w_q, w_k, w_v = module.in_proj_weight.chunk(3, dim=0)  # (D, D) each
        else:
            w_q, w_k, w_v = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight  # (D, D), (D, kdim), (D, vdim)
        has_bias = module.in_proj_bias is not None
        if has_bias != (module.out_proj.bias is not None):
            raise ValueError("from_torch: in_proj_bias and out_proj.bias must both exist or both be None")
        ours = cls(
            module.embed_dim, module.num_heads, d_context=module.kdim, bias=has_bias,
            dropout=float(module.dropout), batch_first=bool(module.batch_first),
        )
        ours.to(device=w_q.device, dtype=w_q.dtype)
        with torch.no_grad():
            ours.q_proj.weight.copy_(w_q)
            ours.k_proj.weight.copy_(w_k)
            ours.v_proj.weight.copy_(w_v)
            ours.out_proj.weight.copy_(module.out_proj.weight)
            if has_bias:
                b_q, b_k, b_v = module.in_proj_bias.chunk(3)  # (D,) each
                ours.q_proj.bias.copy_(b_q)
                ours.k_proj.bias.copy_(b_k)
                ours.v_proj.bias.copy_(b_v)
                ours.out_proj.bias.copy_(module.out_proj.bias)
        ours.train(module.training)
        return ours

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty `KVCache` for this layer, on the device and in the dtype of its weights."""
        cfg = self.config
        weight = self.k_proj.weight
        return KVCache(
            batch_size, max_len, cfg.num_kv_heads, cfg.d_k, cfg.d_v, dtype=weight.dtype, device=weight.device
        )

    def extra_repr(self) -> str:
        cfg = self.config
        return (
            f"d_model={cfg.d_model}, num_heads={cfg.num_heads}, num_kv_heads={cfg.num_kv_heads}, "
            f"d_k={cfg.d_k}, d_v={cfg.d_v}, d_context={cfg.d_context}, dropout={cfg.dropout}"
            + ("" if cfg.batch_first else ", batch_first=False")
            + ("" if self.position_bias is None else f", position_bias={self.position_bias.describe()}")
            + ("" if self.softcap is None else f", softcap={self.softcap:g}")
        )

    def _check_inputs(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None,
        mask: torch.Tensor | Mask | None,
        cache: KVCache | None,
        wide: bool = False,
    ) -> None:
        """Every user error is raised here, before any projection runs (``wide``: x is in the
        float32 the layer computes in, `forward_float32`)."""
        cfg = self.config
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != cfg.d_model:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"MultiHeadAttention: x must have shape (B, L, {cfg.d_model}), got {got}")
        if not x.is_floating_point():
            raise TypeError(f"MultiHeadAttention: x must be a floating-point tensor, got {x.dtype}")
        weight = self.q_proj.weight
        # autocast picks the products' dtype itself; forward_float32 takes the compute dtype
        autocast = autocast_dtype(x) is not None or wide
        for name, t in (("x", x), ("context", context)):
            if isinstance(t, torch.Tensor) and ((t.dtype != weight.dtype and not autocast) or t.device != weight.device):
                raise TypeError(
                    f"MultiHeadAttention: {name} is {t.dtype} on {t.device} but the layer's weights are "
                    f"{weight.dtype} on {weight.device}; convert one of them (module.to({t.dtype}) or "
                    f"{name}.to({weight.dtype})), or run under torch.autocast"
                )
        B, L, _ = x.shape
        if context is None:
            if cfg.d_context != cfg.d_model:
                raise ValueError(
                    f"MultiHeadAttention(d_context={cfg.d_context}) is a cross-attention layer: pass context (B, S, {cfg.d_context})"
                )
            S = L
        else:
            if not isinstance(context, torch.Tensor) or context.ndim != 3 or context.shape[-1] != cfg.d_context:
                got = tuple(context.shape) if isinstance(context, torch.Tensor) else type(context).__name__
                raise ValueError(f"MultiHeadAttention: context must have shape (B, S, {cfg.d_context}), got {got}")
            if context.shape[0] != B:
                raise ValueError(f"MultiHeadAttention: x has batch {B} but context has batch {context.shape[0]}")
            if self.rope is not None:
                raise ValueError("MultiHeadAttention: rope applies to self-attention only; context must be None")
            if cache is not None:
                raise ValueError("MultiHeadAttention: the KV cache is for self-attention decoding; context must be None")
            S = context.shape[1]
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"MultiHeadAttention: cache must be a qkv.KVCache, got {type(cache).__name__}")
            if cache.num_kv_heads != cfg.num_kv_heads or cache.k.shape[-1] != cfg.d_k or cache.v.shape[-1] != cfg.d_v:
                raise ValueError(
                    f"MultiHeadAttention: {cache} does not fit this layer "
                    f"(num_kv_heads={cfg.num_kv_heads}, d_k={cfg.d_k}, d_v={cfg.d_v}); use new_cache()"
                )
            cache.check_append(B, L)
            S = cache.length + L
        if self.rope is not None:
            self.rope.check_positions(cache.length if cache is not None else 0, L)
        if isinstance(mask, torch.Tensor):
            normalize_mask(mask, x, (B,), cfg.num_heads, L, S)  # raises on a bad shape, dtype or value
        elif isinstance(mask, Mask):
            mask.validate(B, cfg.num_heads, L, S)  # e.g. a key_padding mask of the wrong length
        elif mask is not None:
            normalize_mask(mask, x, (B,), cfg.num_heads, L, S)  # raises the TypeError of qkv.attention

    def _emulated(self, x: torch.Tensor, cache: KVCache | None) -> torch.dtype | None:
        """float32 when this CPU only emulates the products of the layer's dtype (bf16 without
        AVX-512 BF16 / AMX, `qkv.native.machine.compute_dtype`) and the call can run in float32
        throughout: no KV cache (it stores the layer's dtype) and no autocast. None otherwise."""
        wide = self.emulated_compute_dtype(x.device)
        if wide is None or x.dtype != self.q_proj.weight.dtype or cache is not None or autocast_dtype(x) is not None:
            return None
        return wide

    def _linear(self, layer: nn.Linear, x: torch.Tensor, wide: bool) -> torch.Tensor:
        """``layer(x)``: in float32 with the weights converted once when ``wide``
        (`onednn_linear.run_wide`), else oneDNN's bf16 linear in bf16 inference, bias in the
        epilogue (or the module's own call, `onednn_linear.run`)."""
        return onednn_linear.run_wide(layer, x) if wide else onednn_linear.run(layer, x)

    def _project(
        self, x: torch.Tensor, context: torch.Tensor | None, wide: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head q (B, H, L, E), k (B, G, S, E), v (B, G, S, Ev); ``wide``: x and context
        are float32 for a layer whose dtype this CPU only emulates (`_emulated`)."""
        cfg = self.config
        H, G, E, Ev = cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
        B, L, _ = x.shape
        rows = B * L
        parts = (self.q_proj, self.k_proj, self.v_proj)
        plain = not wide or all(onednn_linear.run_wide_is_plain(p) for p in parts)
        if context is not None or rows < cfg.d_model * _FUSE_ROWS_PER_WIDTH or not plain:
            source = x if context is None else context
            S = source.shape[1]
            q = self._linear(self.q_proj, x, wide).view(B, L, H, E).transpose(1, 2)  # (B, H, L, E)
            k = self._linear(self.k_proj, source, wide).view(B, S, G, E).transpose(1, 2)  # (B, G, S, E)
            v = self._linear(self.v_proj, source, wide).view(B, S, G, Ev).transpose(1, 2)  # (B, G, S, Ev)
            return q, k, v
        # Self-attention on many rows: one matrix multiply over the three weights side by side
        # reads x once and runs a wider, more efficient product.
        if wide:  # the float32 concatenation, made once while the weights do not change
            weight = onednn_linear.wide_copy(x.dtype, *(p.weight for p in parts))  # (H*E + G*E + G*Ev, D)
            bias = onednn_linear.wide_copy(x.dtype, *(p.bias for p in parts)) if cfg.bias else None
            qkv = F.linear(x, weight, bias)  # (B, L, H*E + G*E + G*Ev)
        else:
            weight, bias = self._fused_projection()  # (H*E + G*E + G*Ev, D), (H*E + G*E + G*Ev,) or None
            qkv = onednn_linear.linear(x, weight, bias)  # (B, L, H*E + G*E + G*Ev); bf16 inference: bias in the epilogue
        if cfg.num_heads == cfg.num_kv_heads and cfg.d_k == cfg.d_v:
            # one copy to head-major order: each head's rows contiguous, which the attention
            # kernel reads faster than the interleaved product (and its input checks too)
            q, k, v = qkv.view(B, L, 3, H, E).permute(2, 0, 3, 1, 4).contiguous().unbind(0)  # 3 x (B, H, L, E)
            return q, k, v
        q, k, v = qkv.split((H * E, G * E, G * Ev), dim=-1)  # (B, L, H*E), (B, L, G*E), (B, L, G*Ev)
        q = q.reshape(B, L, H, E).transpose(1, 2).contiguous()  # (B, H, L, E)
        k = k.reshape(B, L, G, E).transpose(1, 2).contiguous()  # (B, G, L, E)
        v = v.reshape(B, L, G, Ev).transpose(1, 2).contiguous()  # (B, G, L, Ev)
        return q, k, v

    def _fused_projection(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The q, k, v weights (and biases) side by side, concatenated on every call.

        Keeping the concatenation between calls would save a copy of the weights (small
        against the product on many rows), but no key tells reliably when it is stale: an
        update through ``.data`` (``p.data.mul_(m)``, the usual EMA / momentum-encoder step)
        changes the values without touching the parameter's version counter or address.
        """
        parts = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight for p in parts])  # (H*E + G*E + G*Ev, D)
        bias = torch.cat([p.bias for p in parts]) if self.config.bias else None  # (H*E + G*E + G*Ev,)
        return weight, bias

    @overload
    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = ...,
        *,
        mask: torch.Tensor | Mask | None = ...,
        cache: KVCache | None = ...,
        return_weights: Literal[False] = ...,
    ) -> torch.Tensor: ...

    @overload
    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = ...,
        *,
        mask: torch.Tensor | Mask | None = ...,
        cache: KVCache | None = ...,
        return_weights: Literal[True],
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @overload
    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = ...,
        *,
        mask: torch.Tensor | Mask | None = ...,
        cache: KVCache | None = ...,
        return_weights: bool = ...,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | Mask | None = None,
        cache: KVCache | None = None,
        return_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from x to itself (context None) or to context.

        Args:
            x: (B, L, D) queries' inputs.
            context: (B, S, Dc) keys' and values' inputs for cross-attention, or None.
            mask: anything `qkv.attention` takes, over (B, H, L, S): a bool tensor (True = may
                attend) or float tensor (added to scaled scores) broadcastable to (B, H, L, S),
                e.g. a key-padding mask (B, 1, 1, S); or a `qkv.masks` object. With a cache,
                S counts every cached position, and ``qkv.masks.causal()`` (bottom-right)
                makes new queries see the whole cache and the new keys up to themselves.
            cache: a `KVCache` (self-attention): the new keys and values are appended and the
                queries attend to everything cached; RoPE positions continue from its length.
            return_weights: also return the exact per-head weights (B, H, L, S), float32 or
                wider (after dropout in training mode, when dropout > 0).

        Returns:
            out (B, L, D), or (out, weights) when return_weights. With batch_first=False, x
            and context are (L, B, D) and (S, B, Dc) and out is (L, B, D).

        A call that raises leaves the cache as it was (same length, same contents).
        """
        if not self.config.batch_first:
            x = x.transpose(0, 1) if isinstance(x, torch.Tensor) and x.ndim == 3 else x  # (B, L, D)
            if isinstance(context, torch.Tensor) and context.ndim == 3:
                context = context.transpose(0, 1)  # (B, S, Dc)
        self._check_inputs(x, context, mask, cache)
        cfg = self.config
        dtype, wide = x.dtype, self._emulated(x, cache)
        if wide is not None:
            # products in the layer's dtype are emulated on this CPU: run in float32 from the first
            # product to the last (weights converted once, `onednn_linear.wide_copy`), round once
            note_computed_wide(dtype, x.device)
            x = x.to(wide)  # (B, L, D)
            context = None if context is None else context.to(wide)  # (B, S, Dc)
        out, weights = self._attend(x, context, mask, cache, return_weights, wide is not None)  # (B, L, D)
        if wide is not None:
            out = out.to(dtype)  # (B, L, D)
        if not cfg.batch_first:
            out = out.transpose(0, 1)  # (L, B, D)
        if return_weights:
            assert weights is not None
            return out, weights
        return out

    def forward_float32(
        self, x: torch.Tensor, *, mask: torch.Tensor | Mask | None = None, return_weights: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Self-attention for a low-precision layer on a CPU that only emulates its products
        (`emulated_compute_dtype` is float32), on x (B, L, D) already in float32 (batch first):
        (out (B, L, D) float32, weights (B, H, L, S) or None). The products run in float32 as
        in `forward`, without rounding x to the layer's dtype and the output back: for a caller
        whose residual stream is float32 (`qkv.models.BertEncoder`). Checked as `forward`
        checks x in the layer's dtype; runs no module hooks (call the module when one is set)."""
        weight = self.q_proj.weight
        if self.emulated_compute_dtype(x.device) != x.dtype or not self.config.batch_first:
            raise TypeError(
                f"MultiHeadAttention.forward_float32: x is {x.dtype} but this layer computes in "
                f"{self.emulated_compute_dtype(x.device)} here (weights {weight.dtype}, batch_first="
                f"{self.config.batch_first}); call the module instead"
            )
        self._check_inputs(x, None, mask, None, wide=True)
        return self._attend(x, None, mask, None, return_weights, True)

    def emulated_compute_dtype(self, device: torch.device) -> torch.dtype | None:
        """float32 when this CPU only emulates the products of the layer's dtype (bf16 without
        AVX-512 BF16 / AMX, `qkv.native.machine.compute_dtype`), else None."""
        dtype = self.q_proj.weight.dtype
        wide = compute_dtype(dtype, device)
        return None if wide == dtype else wide

    def _attend(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None,
        mask: torch.Tensor | Mask | None,
        cache: KVCache | None,
        return_weights: bool,
        wide: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The projections, attention and output projection on checked inputs (batch first):
        (out (B, L, D), weights (B, H, L, S) or None); ``wide``: in float32 (`_emulated`)."""
        cfg = self.config
        H, Ev = cfg.num_heads, cfg.d_v
        B, L, _ = x.shape
        q, k, v = self._project(x, context, wide)  # (B, H, L, E), (B, G, S_new, E), (B, G, S_new, Ev)
        if self.rope is not None:
            offset = cache.length if cache is not None else 0
            q = self.rope(q, offset)  # (B, H, L, E)
            k = self.rope(k, offset)  # (B, G, S_new, E)
        dropout = cfg.dropout if self.training else 0.0
        bias = self._position_bias()
        if cache is not None:
            length, maxima, versions = cache.length, (cache.k_max, cache.v_max), cache._versions
            k, v = cache.update(k, v)  # (B, G, S, E), (B, G, S, Ev)
            try:
                result = attention(
                    q, k, v, mask, bias=bias, softcap=self.softcap, dropout=dropout, return_weights=return_weights,
                    kv_bounds=cache.bounds,
                )  # the checks read the new rows only, not the cache
            except BaseException:
                cache.truncate(length)  # what attention refused never happened to the cache
                cache.k_max, cache.v_max = maxima  # nor to its bounds
                cache._versions = versions  # behind the storage now: the next step scans it again
                raise
        else:
            result = attention(
                q, k, v, mask, bias=bias, softcap=self.softcap, dropout=dropout, return_weights=return_weights
            )
        heads, weights = result if isinstance(result, tuple) else (result, None)  # (B, H, L, Ev)
        concat = heads.transpose(1, 2).reshape(B, L, H * Ev)  # (B, L, H*Ev)
        return self._linear(self.out_proj, concat, wide), weights  # (B, L, D)
