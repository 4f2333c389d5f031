"""The float64 oracle of the compat tests: attention from an explicit allowed-pairs matrix.

Each peer's documented rules (written out in its test file) produce ``allowed`` (which
pairs take part) and ``bias`` (what is added to the scores); this module does the rest the
same way for all of them: scores = scale * q k^T, an optional softcap, + bias, softmax over
the allowed keys, a row with none giving zeros and lse -inf.
"""

from __future__ import annotations

import torch


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, H, L, E), k (B, G, S, E), v (B, G, S, Ev) -> out (B, H, L, Ev), lse (B, H, L), probs (B, H, L, S)."""
    q, k, v = q.double(), k.double(), v.double()
    H, G = q.shape[-3], k.shape[-3]
    k = k.repeat_interleave(H // G, dim=-3)  # (B, H, S, E): query head h reads h // (H // G)
    v = v.repeat_interleave(H // G, dim=-3)  # (B, H, S, Ev)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = scale * q @ k.transpose(-1, -2)  # (B, H, L, S)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.double()
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, L), -inf for a row with no allowed key
    probs = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
    return probs @ v, lse, probs
