"""`Inspection.rollout` against a NumPy implementation of Abnar & Zuidema (2020) written here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.viz._inspections import make_inspection


def numpy_rollout(attentions: np.ndarray, through: int) -> np.ndarray:
    """joint_0 = A_0; joint_l = A_l @ joint_{l-1}, with A_l = rownorm(0.5 mean_h W + 0.5 I)."""
    T = attentions.shape[-1]
    joint = None
    for layer in range(through + 1):
        a = 0.5 * attentions[layer].mean(axis=0) + 0.5 * np.eye(T)
        a = a / a.sum(axis=-1, keepdims=True)
        joint = a if joint is None else a @ joint
    return joint


def test_rollout_matches_numpy_layer_by_layer() -> None:
    inspection = make_inspection([["a"], ["b", "##c"], ["d"]], layers=3, heads=2, seed=3)
    weights = inspection.attentions.double().numpy()
    for through in range(3):
        np.testing.assert_allclose(inspection.rollout(through).numpy(), numpy_rollout(weights, through), rtol=1e-12)
    np.testing.assert_allclose(inspection.rollout().numpy(), numpy_rollout(weights, 2), rtol=1e-12)
    np.testing.assert_allclose(inspection.rollout().sum(dim=-1).numpy(), 1.0, rtol=1e-12)


def test_order_matters_and_later_layers_are_on_the_left() -> None:
    # Layer 0: every token looks at token 0. Layer 1: every token looks at the next one (the
    # last at itself). At the top, token 0 keeps half of itself (residual of layer 1, then all
    # of token 0 at layer 0) and takes half from token 1, whose layer-0 input is half token 0,
    # half token 1: [0.5 + 0.25, 0.25, 0].
    T = 3
    first = torch.zeros(T, T)
    first[:, 0] = 1.0
    following = torch.zeros(T, T)
    following[0, 1] = following[1, 2] = following[2, 2] = 1.0
    inspection = make_inspection([["a"]], layers=2, heads=1)
    attentions = torch.stack([first, following])[:, None]  # (layers=2, heads=1, T, T)
    inspection = type(inspection)(**{**inspection.__dict__, "attentions": attentions})
    a0 = 0.5 * first.double() + 0.5 * torch.eye(T, dtype=torch.float64)
    a1 = 0.5 * following.double() + 0.5 * torch.eye(T, dtype=torch.float64)
    torch.testing.assert_close(inspection.rollout(), a1 @ a0)
    assert not torch.allclose(a1 @ a0, a0 @ a1)
    torch.testing.assert_close(inspection.rollout()[0], torch.tensor([0.75, 0.25, 0.0], dtype=torch.float64))


def test_rollout_refuses_a_layer_out_of_range() -> None:
    inspection = make_inspection([["a"]], layers=2, heads=1)
    with pytest.raises(ValueError, match="through must be a layer in \\[0, 2\\)"):
        inspection.rollout(2)
