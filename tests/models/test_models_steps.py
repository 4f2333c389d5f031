"""`Inspection.steps`, `head_roles` and `rollout` on all-MiniLM-L6-v2, against transformers'
eager BertModel: its query/key/value projections, attention probabilities and per-head
context vectors are read with forward hooks on the independent implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qkv import reference
from qkv.models import Encoder, head_roles

TEXT = "The trophy did not fit into the suitcase because it was too big."


@pytest.fixture(scope="module")
def hf_run(hf_model, encoder: Encoder) -> dict:
    """Every layer's query, key, value outputs (T, D), self-attention context (T, D) and
    attention probabilities (H, T, T) from transformers."""
    captured: dict = {"q": [], "k": [], "v": [], "context": []}
    hooks = []
    for layer in hf_model.encoder.layer:
        attention = layer.attention.self
        for name, module in (("q", attention.query), ("k", attention.key), ("v", attention.value)):
            hooks.append(module.register_forward_hook(lambda m, i, out, name=name: captured[name].append(out[0])))
        hooks.append(attention.register_forward_hook(lambda m, i, out: captured["context"].append(out[0][0])))
    ids = torch.tensor([encoder.tokenizer.encode(TEXT).ids])
    try:
        with torch.no_grad():
            captured["attentions"] = hf_model(ids, output_attentions=True).attentions
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def test_projections_are_transformers_q_k_v(encoder: Encoder, hf_run: dict) -> None:
    p = encoder.inspect(TEXT).projections
    layers, H, T, E = p.q.shape
    for layer in range(layers):
        for name, ours in (("q", p.q), ("k", p.k), ("v", p.v)):
            theirs = hf_run[name][layer].view(T, H, E).transpose(0, 1)  # (H, T, E)
            torch.testing.assert_close(ours[layer], theirs, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("layer", "head"), [(0, 0), (2, 7), (5, 11)])
def test_steps_give_transformers_weights_and_context(encoder: Encoder, hf_run: dict, layer: int, head: int) -> None:
    inspection = encoder.inspect(TEXT)
    query = inspection.find("it")[0]
    t = inspection.steps(layer, head, query)
    E = t.q.shape[0]
    hf_weights = hf_run["attentions"][layer][0, head, query].double().numpy()  # (T,)
    np.testing.assert_allclose(t.weights, hf_weights, atol=2e-6)
    np.testing.assert_allclose(t.weights, inspection.attentions[layer, head, query].double().numpy(), atol=2e-6)
    hf_context = hf_run["context"][layer][query, head * E : (head + 1) * E].double().numpy()  # (Ev,)
    np.testing.assert_allclose(t.output, hf_context, atol=2e-5)
    assert t.scale == pytest.approx(1 / np.sqrt(E))
    ref = reference.attention(t.q[None], t.k, t.v)
    np.testing.assert_allclose(t.weights, ref.weights[0], rtol=1e-12)
    np.testing.assert_allclose(t.exponentials / t.total, t.weights, rtol=1e-12)


def test_rollout_of_transformers_attentions(encoder: Encoder, hf_run: dict) -> None:
    inspection = encoder.inspect(TEXT)
    T = len(inspection.tokens)
    joint = np.eye(T)
    for weights in hf_run["attentions"]:  # layer 0 first
        a = 0.5 * weights[0].double().numpy().mean(axis=0) + 0.5 * np.eye(T)
        joint = (a / a.sum(axis=-1, keepdims=True)) @ joint
    np.testing.assert_allclose(inspection.rollout().numpy(), joint, atol=1e-6)


def test_head_roles_over_texts_average_each_text(encoder: Encoder) -> None:
    texts = [TEXT, "Where did you park the car?"]
    roles = head_roles(encoder, texts)
    one, two = (encoder.inspect(t).head_roles() for t in texts)
    torch.testing.assert_close(roles.shares, (one.shares + two.shares) / 2)
    torch.testing.assert_close(roles.shares.sum(dim=-1), torch.ones(6, 12, dtype=torch.float64))
    assert roles.texts == 2
    with pytest.raises(ValueError, match="text 1 is empty"):
        head_roles(encoder, [TEXT, "  "])
    with pytest.raises(ValueError, match="exceed the model's 512 positions"):
        head_roles(encoder, ["word " * 600])
