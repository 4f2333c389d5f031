"""Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers").

A token's output at the top of the model has been mixed through every layer, and each
layer's residual connection carries the token's own vector past its attention. Rollout
follows both paths through the stack:

    A_l     = 0.5 * mean_h attentions[l, h] + 0.5 * I      (the residual as an identity map)
    A_l     = A_l / rowsum(A_l)                             (rows sum to 1 again)
    rollout = A_{n-1} @ ... @ A_1 @ A_0                      (the layer above on the left)

The order: row i of A_l says what token i's input to layer l + 1 takes from its inputs to
layer l, so the flow from the embeddings to the top reads A_{n-1} ... A_0, later layers on
the left. This is the order of the paper's `compute_joint_attention` (joint_l = A_l @
joint_{l-1}) and of the common ViT implementations (``result = a @ result``). Row i of the
rollout is how much the top-layer token i draws from each input token j; rows sum to 1.
"""

from __future__ import annotations

import torch

__all__ = ["RESIDUAL_SHARE", "rollout"]

RESIDUAL_SHARE = 0.5  # the paper's equal split between attention and the residual path


def rollout(attentions: torch.Tensor, through: int | None = None) -> torch.Tensor:
    """The rollout (T, T) float64 of attentions (layers, H, T, T) from the embeddings up to
    and including layer ``through`` (default: the last layer)."""
    if attentions.ndim != 4 or attentions.shape[-1] != attentions.shape[-2]:
        raise ValueError(f"attentions must be (layers, heads, T, T), got {tuple(attentions.shape)}")
    layers, T = int(attentions.shape[0]), int(attentions.shape[-1])
    last = layers - 1 if through is None else through
    if isinstance(last, bool) or not isinstance(last, int) or not 0 <= last < layers:
        raise ValueError(f"through must be a layer in [0, {layers}), got {through!r}")
    identity = torch.eye(T, dtype=torch.float64)  # (T, T)
    flow = identity
    for layer in range(last + 1):
        mean = attentions[layer].detach().to("cpu", torch.float64).mean(dim=0)  # (T, T)
        step = (1 - RESIDUAL_SHARE) * mean + RESIDUAL_SHARE * identity  # (T, T)
        step = step / step.sum(dim=-1, keepdim=True)  # rows of a masked model may not sum to 1
        flow = step @ flow  # (T, T): the new layer on the left
    return flow
