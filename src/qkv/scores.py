"""Score terms beyond q.k: softcap, additive bias and score_mod, applied in one order everywhere.

Per (b, h, i, j), after the scaled dot product s = scale * q_i . k_j (docs/design.md):

    s = softcap * tanh(s / softcap)          when a softcap is set (Gemma 2)
    s = s + bias[b, h, i, j]                 a `qkv.bias` object
    s = score_mod(s, b, h, i, j)             FlexAttention's score_mod contract

then masked pairs are removed and each row is softmaxed. `ScoreTerms.apply` is that order,
on broadcasting index tensors, so the math path (whole score matrix), the CPU engine (one
tile) and FlexAttention (one score at a time) share it. Everything is differentiable with
autograd: q, k, the bias tensors and whatever score_mod closes over receive gradients.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qkv._checks import broadcasts
from qkv.bias import Bias

__all__ = ["ScoreMod", "ScoreTerms", "check_softcap"]


ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# FLOPs per pair of a softcap: a division, a tanh (counted as one), a multiplication.
_SOFTCAP_FLOPS = 3
# A score_mod is opaque; it is counted as one operation per pair.
_SCORE_MOD_FLOPS = 1


def check_softcap(softcap: object) -> float | None:
    """None, or a positive finite float (ValueError otherwise); like ``scale``, a NumPy scalar
    or a one-element tensor without gradient counts as its number."""
    if softcap is None:
        return None
    if isinstance(softcap, torch.Tensor) and softcap.numel() == 1 and not softcap.requires_grad:
        softcap = softcap.item()  # a complex or bool tensor becomes a complex or bool: refused below
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not (0.0 < float(softcap) < float("inf")):
        raise ValueError(f"softcap must be a positive finite number, got {softcap!r}")
    return float(softcap)


@dataclass(frozen=True, eq=False)
class ScoreTerms:
    """The score terms of one problem (L queries, S keys), the bias already bound to it.

    ``positions`` (N | 1, L) int64 is each query's absolute position in key coordinates,
    taken from the mask (`qkv.masks.varlen` / `padded`: the document's own); None means
    bottom-right, i + S - L.
    """

    L: int
    S: int
    softcap: float | None = None
    bias: Bias | None = None
    score_mod: ScoreMod | None = None
    positions: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return self.softcap is not None or self.bias is not None or self.score_mod is not None

    @property
    def shift_invariant(self) -> bool:
        """Whether a tile's terms depend on its diagonal only (its bias can be reused)."""
        return (
            self.score_mod is None
            and self.positions is None
            and (self.bias is None or self.bias.shift_invariant)
        )

    @property
    def batch_varies(self) -> bool:
        """Whether the terms differ between batch rows."""
        return self.score_mod is not None or (self.bias is not None and self.bias.batch is not None) or (
            self.positions is not None and self.positions.shape[0] > 1
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return () if self.bias is None else self.bias.tensors()

    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in self.tensors())

    def q_pos(self, b: torch.Tensor, q_idx: torch.Tensor) -> torch.Tensor:
        """Absolute position of each query in key coordinates (broadcast of b and q_idx)."""
        if self.positions is None:
            return q_idx + (self.S - self.L)
        positions = self.positions.to(q_idx.device)
        rows = b if positions.shape[0] > 1 else torch.zeros_like(b)
        return positions[rows, q_idx]

    def apply(
        self,
        s: torch.Tensor,
        b: torch.Tensor,
        h: torch.Tensor,
        q_idx: torch.Tensor,
        kv_idx: torch.Tensor,
        *,
        inplace: bool = False,
    ) -> torch.Tensor:
        """The terms applied to scaled scores s, in docs/design.md's order; the result has s's shape.

        ``inplace``: s is a temporary without autograd history and may be overwritten (the
        engine's forward tiles: fewer passes over the scores)."""
        if self.softcap is not None:
            if inplace:
                s = s.div_(self.softcap).tanh_().mul_(self.softcap)
            else:
                s = torch.tanh(s / self.softcap) * self.softcap
        if self.bias is not None:
            terms = self.bias.terms(b, h, q_idx, kv_idx, self.q_pos(b, q_idx)).to(s.dtype)
            # in place only where terms broadcast to s (s += terms keeps s's shape)
            s = s.add_(terms) if inplace and broadcasts(terms.shape, s.shape) else s + terms
        if self.score_mod is not None:
            modified = self.score_mod(s, b, h, q_idx, kv_idx)
            if not isinstance(modified, torch.Tensor) or not modified.is_floating_point():
                got = modified.dtype if isinstance(modified, torch.Tensor) else type(modified).__name__
                raise TypeError(f"score_mod(score, b, h, q_idx, kv_idx) must return a float tensor, got {got}")
            try:
                full = modified if modified.shape == s.shape else torch.broadcast_to(modified, s.shape).contiguous()
                s = full.to(s.dtype)
            except RuntimeError as error:
                raise ValueError(
                    f"score_mod returned shape {tuple(modified.shape)}, which does not broadcast to the "
                    f"scores' {tuple(s.shape)}"
                ) from error
        return s

    def flops_per_pair(self) -> int:
        flops = _SOFTCAP_FLOPS if self.softcap is not None else 0
        flops += self.bias.flops_per_pair() if self.bias is not None else 0
        return flops + (_SCORE_MOD_FLOPS if self.score_mod is not None else 0)

    def describe(self) -> str:
        """E.g. ``softcap 50 + alibi(8 heads) + score_mod(fn)``; '' when there is no term."""
        parts = []
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}")
        if self.bias is not None:
            parts.append(self.bias.describe())
        if self.score_mod is not None:
            parts.append(f"score_mod({getattr(self.score_mod, '__name__', type(self.score_mod).__name__)})")
        return " + ".join(parts)
