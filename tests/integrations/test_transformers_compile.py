"""The transformers backend under torch.compile(fullgraph=True): a tiny random sliding-window
model (Mistral-style, built from a config, nothing downloaded) traces as one graph and its
compiled logits equal transformers' own eager attention on the same weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.integrations import _tiny_models as tiny


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_model_compiles_fullgraph_and_equals_transformers_eager(family: str) -> None:
    torch.manual_seed(0)
    config = tiny.mistral(window=5) if family == "mistral" else tiny.gemma2(window=5)
    models = tiny.trio(config)
    ours = models[tiny.NAME]
    ids = torch.randint(3, tiny.VOCAB, (2, 12))  # 12 tokens: the window of 5 hides keys
    with torch.no_grad():
        expected = models["eager"](ids).logits  # transformers' own attention, the independent source
        ours(ids)  # an eager call installs the backend's cache hook on every attention module: it traces too
        assert all(len(layer.self_attn._forward_pre_hooks) == 1 for layer in ours.model.layers)
        report = torch._dynamo.explain(ours)(ids)
        assert report.graph_break_count == 0, [r.reason for r in report.break_reasons]
        torch._dynamo.reset()
        compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")(ids).logits
    torch.testing.assert_close(compiled, expected, atol=2e-6, rtol=0)


@pytest.mark.parametrize("padding", ["all ones", "left padding"])
def test_compiled_with_an_attention_mask_traces_whole(padding: str) -> None:
    """A 2-D attention_mask, as a tokenizer returns it: its values cannot be read while Dynamo
    traces (formerly `bool(valid.all())` broke the graph, and fullgraph=True raised), so the
    padding stays a key_padding mask even where it hides nothing. Real tokens' logits equal
    transformers' own eager attention given the same mask."""
    torch.manual_seed(0)
    models = tiny.trio(tiny.mistral(window=5))
    ours = models[tiny.NAME]
    ids = torch.randint(3, tiny.VOCAB, (2, 12))
    attention_mask = torch.ones(2, 12, dtype=torch.long)
    if padding == "left padding":
        attention_mask[0, :3] = 0  # row 0: three pad tokens first
    real = attention_mask.bool()
    with torch.no_grad():
        expected = models["eager"](ids, attention_mask=attention_mask).logits
        ours(ids, attention_mask=attention_mask)
        report = torch._dynamo.explain(ours)(ids, attention_mask=attention_mask)
        assert report.graph_break_count == 0, [r.reason for r in report.break_reasons]
        torch._dynamo.reset()
        compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")(ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(compiled[real], expected[real], atol=2e-6, rtol=0)
