"""Positional encodings: attention alone cannot tell token order apart.

Permuting the rows of x permutes the rows of attention's output the same way (the seeds'
permutation equivariance), so a model learns word order only when positions are written into
the vectors. Three ways are in use:

- `SinusoidalEncoding` (Vaswani et al. 2017, "Attention Is All You Need", section 3.5):
  PE(pos, 2i) = sin(pos / base^(2i/D)), PE(pos, 2i+1) = cos(pos / base^(2i/D)), added to x.
- `LearnedEncoding` (BERT, GPT-2): one trained vector per position, added to x.
- `RotaryEmbedding` (Su et al. 2021, "RoFormer"): q and k of each head are rotated, pair of
  features by pair of features, by the angle pos * theta_i with theta_i = base^(-2i/E). A
  rotation by m*theta then by -n*theta is a rotation by (m - n)*theta, so q_m . k_n depends
  on the positions only through m - n.

RoPE layouts: "half" pairs feature i with feature i + E/2 (GPT-NeoX, Llama, Hugging Face's
``rotate_half``); "interleaved" pairs features 2i and 2i + 1 (GPT-J, the RoFormer paper).
A checkpoint works only with the layout it was trained with.

Numerics: the angle tables are computed once in float64 and held in float32, whatever the
model dtype (``module.to(torch.bfloat16)`` keeps them float32). A float32 angle pos * theta
would carry an absolute error of about pos * 6e-8 rad (6e-3 at pos = 1e5); computing it in
float64 first leaves only the float32 rounding of cos and sin themselves.

Shape legend (docs/design.md): B batch, H heads, L length, E head dim, D model width.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from qkv._checks import positive_int
from qkv.backends.softmax import accumulation_dtype

__all__ = ["LearnedEncoding", "RotaryConfig", "RotaryEmbedding", "SinusoidalEncoding"]

Layout = Literal["half", "interleaved"]
LAYOUTS: tuple[str, ...] = ("half", "interleaved")


def _check_base(base: object) -> float:
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 1.0:
        raise ValueError(f"base must be a finite number > 1, got {base!r}")
    return float(base)


def check_positions(offset: int, length: int, max_len: int, owner: str) -> None:
    """Raise a ValueError unless positions offset .. offset + length - 1 are below max_len."""
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"{owner}: offset must be an int >= 0, got {offset!r}")
    if offset + length > max_len:
        raise ValueError(
            f"{owner}: positions {offset}..{offset + length - 1} go past max_len={max_len} "
            f"(offset {offset} + length {length}); build it with a larger max_len"
        )


class _Float32Tables(nn.Module, ABC):
    """A module whose fixed tables are built in float64 and kept in float32 on any move.

    ``module.to(dtype)`` casts every floating buffer; for these tables that would throw away
    precision for nothing (they are small), so after any move they are rebuilt on the new
    device in float32.
    """

    _table_names: tuple[str, ...]  # the buffers `_build_tables` returns

    @abstractmethod
    def _build_tables(self, device: torch.device | None) -> dict[str, torch.Tensor]:
        """The tables by buffer name, float32, on ``device`` (CPU when None)."""

    def _register_tables(self, device: torch.device | None) -> None:
        for name, table in self._build_tables(device).items():
            self.register_buffer(name, table, persistent=False)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]  # nn.Module's own signature
        super()._apply(fn, recurse)
        first = self._buffers[self._table_names[0]]
        if first is not None and first.dtype != torch.float32:
            self._register_tables(first.device)
        return self


def sinusoidal_table(max_len: int, d_model: int, base: float = 10000.0) -> torch.Tensor:
    """PE (max_len, D) in float64: PE[pos, 2i] = sin(pos / base^(2i/D)), PE[pos, 2i+1] = cos(same)."""
    positions = torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (ceil(D/2),)
    angles = positions / base ** (two_i / d_model)  # (max_len, ceil(D/2))
    table = torch.empty(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : d_model // 2])  # an odd D has one sine column more
    return table


class SinusoidalEncoding(_Float32Tables):
    """The original paper's fixed encoding, added to the token vectors.

    Args:
        d_model: D, the width of x.
        max_len: positions 0 .. max_len - 1 are tabulated; past them forward raises.
        base: 10000 in the paper; wavelengths run from 2*pi to base * 2*pi.

    ``forward(x (B, L, D), offset=0)`` returns x + PE[offset : offset + L] in x's dtype; pass
    the number of tokens already seen as ``offset`` when decoding step by step.

    Example:
        >>> enc = SinusoidalEncoding(4, max_len=16)
        >>> enc(torch.zeros(1, 2, 4))[0, 0].tolist()  # position 0: sin 0 = 0, cos 0 = 1
        [0.0, 1.0, 0.0, 1.0]
    """

    table: torch.Tensor  # (max_len, D) float32
    _table_names = ("table",)

    def __init__(self, d_model: int, *, max_len: int = 4096, base: float = 10000.0) -> None:
        super().__init__()
        self.d_model = positive_int(d_model, "d_model")
        self.max_len = positive_int(max_len, "max_len")
        self.base = _check_base(base)
        self._register_tables(None)

    def _build_tables(self, device: torch.device | None) -> dict[str, torch.Tensor]:
        table = sinusoidal_table(self.max_len, self.d_model, self.base)  # (max_len, D)
        return {"table": table.to(device=device, dtype=torch.float32)}

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """x (B, L, D) -> x + PE[offset : offset + L], in x's dtype."""
        if x.ndim < 2 or x.shape[-1] != self.d_model:
            raise ValueError(f"SinusoidalEncoding(d_model={self.d_model}) needs x of shape (..., L, {self.d_model}), got {tuple(x.shape)}")
        L = x.shape[-2]
        check_positions(offset, L, self.max_len, "SinusoidalEncoding")
        return x + self.table[offset : offset + L].to(x.dtype)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}, base={self.base:g}"


class LearnedEncoding(nn.Module):
    """One learned vector per position, added to the token vectors (BERT, GPT-2).

    Args:
        d_model: D, the width of x.
        max_len: number of positions with a vector; past them forward raises.
        init_std: standard deviation of the initial vectors (0.02 as in BERT and GPT-2).

    ``forward(x (B, L, D), offset=0)`` returns x + weight[offset : offset + L].
    """

    def __init__(self, d_model: int, max_len: int, *, init_std: float = 0.02) -> None:
        super().__init__()
        self.d_model = positive_int(d_model, "d_model")
        self.max_len = positive_int(max_len, "max_len")
        self.weight = nn.Parameter(torch.randn(max_len, d_model) * init_std)  # (max_len, D)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """x (B, L, D) -> x + weight[offset : offset + L]."""
        if x.ndim < 2 or x.shape[-1] != self.d_model:
            raise ValueError(f"LearnedEncoding(d_model={self.d_model}) needs x of shape (..., L, {self.d_model}), got {tuple(x.shape)}")
        L = x.shape[-2]
        check_positions(offset, L, self.max_len, "LearnedEncoding")
        return x + self.weight[offset : offset + L].to(x.dtype)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}"


@dataclass(frozen=True)
class RotaryConfig:
    """Settings of a rotary embedding."""

    head_dim: int  # E, must be even: features are rotated in E/2 pairs
    max_len: int = 4096  # positions 0 .. max_len - 1 have precomputed angles
    base: float = 10000.0  # theta_i = base^(-2i/E), RoFormer's and Llama 2's choice
    layout: Layout = "half"  # "half": GPT-NeoX / Llama; "interleaved": GPT-J / RoFormer


class RotaryEmbedding(_Float32Tables):
    """Rotary position embedding (RoPE), applied to q and k of every head.

    Args:
        head_dim: E, even.
        max_len: positions 0 .. max_len - 1 are tabulated; asking for more raises.
        base: theta_i = base^(-2i/E).
        layout: "half" (pairs i, i + E/2; GPT-NeoX, Llama) or "interleaved" (pairs 2i, 2i+1;
            GPT-J).

    ``forward(x (..., L, E), offset=0)`` rotates the vector at row l by position offset + l
    and returns (..., L, E) in x's dtype. The product is taken in float32 (float64 for
    float64 inputs), the tables being float32.

    Example:
        >>> rope = RotaryEmbedding(4, max_len=8)
        >>> q, k = torch.randn(1, 4), torch.randn(1, 4)
        >>> a = (rope(q, offset=5) * rope(k, offset=2)).sum()  # positions 5 and 2
        >>> b = (rope(q, offset=3) * rope(k, offset=0)).sum()  # positions 3 and 0
        >>> torch.allclose(a, b, atol=1e-5)
        True
    """

    cos: torch.Tensor  # (max_len, E/2) float32
    sin: torch.Tensor  # (max_len, E/2) float32
    _table_names = ("cos", "sin")

    def __init__(
        self, head_dim: int, *, max_len: int = 4096, base: float = 10000.0, layout: Layout = "half"
    ) -> None:
        super().__init__()
        positive_int(head_dim, "head_dim")
        if head_dim % 2 != 0:
            raise ValueError(f"RoPE rotates features in pairs: head_dim must be even, got {head_dim}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(repr(x) for x in LAYOUTS)}; got {layout!r}")
        self.config = RotaryConfig(head_dim, positive_int(max_len, "max_len"), _check_base(base), layout)
        self._register_tables(None)

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def max_len(self) -> int:
        return self.config.max_len

    @property
    def layout(self) -> Layout:
        return self.config.layout

    def _build_tables(self, device: torch.device | None) -> dict[str, torch.Tensor]:
        cfg = self.config
        two_i = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64)  # (E/2,)
        theta = cfg.base ** (-two_i / cfg.head_dim)  # (E/2,)
        positions = torch.arange(cfg.max_len, dtype=torch.float64)  # (max_len,)
        angles = torch.outer(positions, theta)  # (max_len, E/2), float64 (see module docstring)
        return {
            "cos": torch.cos(angles).to(device=device, dtype=torch.float32),
            "sin": torch.sin(angles).to(device=device, dtype=torch.float32),
        }

    def check_positions(self, offset: int, length: int) -> None:
        """Raise a ValueError unless positions offset .. offset + length - 1 are tabulated."""
        check_positions(offset, length, self.config.max_len, "RotaryEmbedding")

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Rotate x (..., L, E) by positions offset .. offset + L - 1; returns (..., L, E)."""
        E = self.config.head_dim
        if x.ndim < 2 or x.shape[-1] != E:
            raise ValueError(f"RotaryEmbedding(head_dim={E}) needs x of shape (..., L, {E}), got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"RotaryEmbedding needs a floating-point x, got {x.dtype}")
        L = x.shape[-2]
        self.check_positions(offset, L)
        compute = accumulation_dtype(x.dtype)  # float32 at least, float64 kept (docs/design.md)
        cos = self.cos[offset : offset + L].to(compute)  # (L, E/2)
        sin = self.sin[offset : offset + L].to(compute)  # (L, E/2)
        xc = x.to(compute)
        if self.config.layout == "half":
            x1, x2 = xc[..., : E // 2], xc[..., E // 2 :]  # (..., L, E/2) each: pair (i, i + E/2)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (..., L, E)
        else:
            x1, x2 = xc[..., 0::2], xc[..., 1::2]  # (..., L, E/2) each: pair (2i, 2i + 1)
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (..., L, E/2, 2)
            out = out.flatten(-2)  # (..., L, E)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        cfg = self.config
        return f"head_dim={cfg.head_dim}, max_len={cfg.max_len}, base={cfg.base:g}, layout={cfg.layout!r}"
