"""`Inspection.steps` on hand-built projections: every field against explicit float64 math
written here, and against `qkv.reference.attention` on the head's own q, k, v."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qkv import reference
from qkv.inspect import Inspection, Projections


def _inspection(layers=2, H=4, G=2, T=7, E=5, Ev=3, causal=False, seed=0, scale=None) -> Inspection:
    g = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(layers, H, T, E, generator=g, dtype=torch.float64)
    k = 2 * torch.randn(layers, G, T, E, generator=g, dtype=torch.float64)
    v = torch.randn(layers, G, T, Ev, generator=g, dtype=torch.float64)
    scale = 1 / np.sqrt(E) if scale is None else scale
    allowed = torch.ones(T, T, dtype=torch.bool).tril() if causal else None
    # The model's weights, computed the plain way: head h reads key/value head h // (H // G).
    k_per_head = k.repeat_interleave(H // G, dim=1)  # (layers, H, T, E)
    scores = scale * q @ k_per_head.transpose(-1, -2)  # (layers, H, T, T)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    attentions = torch.softmax(scores, dim=-1).float()  # (layers, H, T, T)
    tokens = ["[CLS]", *(f"t{i}" for i in range(T - 2)), "[SEP]"]
    return Inspection(
        text=" ".join(tokens[1:-1]),
        tokens=tokens,
        offsets=[(0, 0)] * T,
        word_ids=[None, *range(T - 2), None],
        attentions=attentions,
        hidden_states=torch.zeros(layers + 1, T, 4),
        projections=Projections(q=q.float(), k=k.float(), v=v.float(), scale=float(scale), allowed=allowed),
    )


@pytest.mark.parametrize("causal", [False, True])
def test_steps_are_the_four_steps_of_that_head(causal: bool) -> None:
    inspection = _inspection(causal=causal)
    p = inspection.projections
    layer, head, query = 1, 3, 4
    t = inspection.steps(layer, head, query)
    q = p.q[layer, head, query].double().numpy()  # (E,)
    k = p.k[layer, head // 2].double().numpy()  # (T, E): head 3 of 4 reads key/value head 1 of 2
    v = p.v[layer, head // 2].double().numpy()  # (T, Ev)
    np.testing.assert_array_equal(t.q, q)
    np.testing.assert_array_equal(t.k, k)
    np.testing.assert_array_equal(t.v, v)
    scores = np.array([sum(q[e] * k[j, e] for e in range(5)) for j in range(7)])  # one dot product per key
    np.testing.assert_allclose(t.scores, scores, rtol=1e-12)
    np.testing.assert_allclose(t.scaled, scores / np.sqrt(5), rtol=1e-12)
    seen = np.arange(7) <= query if causal else np.ones(7, dtype=bool)
    exps = np.where(seen, np.exp(scores / np.sqrt(5)), 0.0)
    np.testing.assert_allclose(t.exponentials, exps, rtol=1e-12)
    assert t.shift == 0.0
    assert t.total == pytest.approx(exps.sum(), rel=1e-12)
    np.testing.assert_allclose(t.weights, exps / exps.sum(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(t.output, (exps / exps.sum()) @ v, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(t.contributions.sum(axis=0), t.output, rtol=1e-12, atol=1e-15)
    norms = np.linalg.norm(t.contributions, axis=1)
    assert list(norms[list(t.largest)]) == sorted(norms, reverse=True)
    assert sorted(t.largest) == list(range(7))
    # And the same numbers from the reference on that head's whole q, k, v.
    mask = seen[None, :] if causal else None
    ref = reference.attention(q[None], k, v, mask=mask, scale=1 / np.sqrt(5))
    for name in ("scores", "scaled", "weights", "output"):
        np.testing.assert_array_equal(getattr(t, name), getattr(ref, name)[0])
    np.testing.assert_allclose(t.weights, inspection.attentions[layer, head, query].numpy(), atol=1e-6)


def test_huge_scores_are_shifted_not_overflowed() -> None:
    inspection = _inspection(scale=300.0)
    t = inspection.steps(0, 0, 2)
    assert t.scaled.max() > 709  # exp would overflow float64
    assert t.shift == t.scaled.max()
    assert np.isfinite(t.exponentials).all() and t.exponentials.max() == 1.0
    np.testing.assert_allclose(t.weights, t.exponentials / t.total, rtol=1e-12)


def test_steps_refuses_weights_it_cannot_reproduce() -> None:
    inspection = _inspection()
    wrong = inspection.attentions.clone()
    wrong[0, 1, 2] = wrong[0, 1, 2].roll(1)
    broken = Inspection(**{**inspection.__dict__, "attentions": wrong})
    with pytest.raises(ValueError, match=r"layer 0 head 1 .* differ from the model's"):
        broken.steps(0, 1, 2)
    broken.steps(0, 0, 2)  # other heads are untouched


@pytest.mark.parametrize(
    ("args", "message"),
    [((2, 0, 0), "layer must be an int in \\[0, 2\\)"), ((0, -1, 0), "head"), ((0, 0, 7), "query"), ((True, 0, 0), "layer")],
)
def test_bad_indices_name_the_argument(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _inspection().steps(*args)


def test_an_inspection_without_projections_says_so() -> None:
    inspection = _inspection()
    bare = Inspection(**{**inspection.__dict__, "projections": None, "model_name": "some-model"})
    with pytest.raises(ValueError, match=r"no per-head projections .*some-model"):
        bare.steps(0, 0, 0)


def test_projections_that_do_not_fit_together_are_refused() -> None:
    q = torch.zeros(2, 4, 7, 5)
    with pytest.raises(ValueError, match="do not fit together"):
        Projections(q=q, k=torch.zeros(2, 3, 7, 5), v=torch.zeros(2, 3, 7, 2), scale=1.0)
    with pytest.raises(ValueError, match="scale must be a positive finite"):
        Projections(q=q, k=q, v=q, scale=float("nan"))
    with pytest.raises(ValueError, match="allowed must be a bool tensor"):
        Projections(q=q, k=q, v=q, scale=1.0, allowed=torch.ones(7, 6, dtype=torch.bool))
