"""The bf16 encoder on its fused ops: oneDNN's linear with bias / GELU in the epilogue
(`qkv.native.onednn_linear`) and the residual add + LayerNorm kernel
(`qkv.native.add_norm_bf16`).

Expected values: qkv's float32 embeddings (checked against sentence-transformers in
test_models_encoder) and sentence-transformers float32; the bar is the issue's cosine of
0.9999 per text. Spies count the fused calls, so the tests fail if the encoder silently
stops taking them on a machine that can run them.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from tests.kernels._spy import CallSpy

import qkv
from qkv.models import Encoder, load_encoder
from qkv.native import add_norm_bf16, onednn_linear
from qkv.native import build as compiled

MIN_COSINE = 0.9999
BF16 = torch.bfloat16


def _linear_runs() -> bool:
    return onednn_linear.unavailable_reason(torch.ones(1, 2, dtype=BF16), torch.ones(3, 2, dtype=BF16)) is None


def _norm_runs() -> bool:
    return compiled.static_reason(BF16, torch.device("cpu")) is None


@pytest.fixture(scope="module")
def bf16_encoder() -> Encoder:
    return load_encoder(dtype=BF16)


def _texts(encoder: Encoder) -> list[str]:
    """Texts of 3 to 130 tokens of vocabulary words, and two natural ones."""
    vocab = sorted(w for w in encoder.tokenizer._tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 2)
    rng = random.Random(1)
    texts = [" ".join(rng.choice(vocab) for _ in range(n)) for n in (1, 5, 17, 60, 128)]
    return [*texts, "The trophy did not fit into the suitcase because it was too big.", "I sat on the bank."]


def test_bf16_encode_runs_the_fused_ops_and_matches_float32(
    encoder: Encoder, bf16_encoder: Encoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = _texts(encoder)
    linear, norm = CallSpy(monkeypatch, onednn_linear, "_fused"), CallSpy(monkeypatch, add_norm_bf16, "_fused")
    eager_linear = CallSpy(monkeypatch, F, "linear")  # what nn.Linear calls
    want = encoder.encode(texts)
    assert linear.calls == norm.calls == 0 and eager_linear.calls > 0  # float32 takes neither
    layers = encoder.config.num_hidden_layers
    fused_linear = _linear_runs()  # its one check (which calls F.linear) runs here, not below
    for packed in (False, True):
        linear.calls = norm.calls = eager_linear.calls = 0
        got = bf16_encoder.encode(texts, batch_size=4, packed=packed)  # two batches
        if fused_linear:  # every product fused: at least q/k/v, out, ffn in and out per layer and batch
            assert eager_linear.calls == 0 and linear.calls >= 4 * layers * 2
        else:
            assert linear.calls == 0
        assert norm.calls == (2 * layers * 2 if _norm_runs() else 0)  # two add + norms per layer and batch
        assert F.cosine_similarity(got, want, dim=1).min().item() >= MIN_COSINE
    with qkv.backends.disabled("onednn_linear", "add_norm_bf16"):
        eager = bf16_encoder.encode(texts)  # the same model on the eager ops
    assert F.cosine_similarity(eager, want, dim=1).min().item() >= MIN_COSINE


def test_bf16_matches_sentence_transformers_float32(bf16_encoder: Encoder, st_model) -> None:
    texts = ["A man is playing a guitar.", "I sat on the bank of the river.", "hi"]
    want = st_model.encode(texts, convert_to_tensor=True)
    assert F.cosine_similarity(bf16_encoder.encode(texts), want, dim=1).min().item() >= MIN_COSINE


def test_hidden_states_stay_float32_and_close_to_float32(encoder: Encoder, bf16_encoder: Encoder) -> None:
    ids = torch.tensor([encoder.tokenizer.encode("The quick brown fox jumps over the lazy dog.").ids])  # (1, T)
    with torch.no_grad():
        ours = bf16_encoder.model(ids, return_hidden=True, return_weights=True)
        want = encoder.model(ids, return_hidden=True).hidden_states
    assert len(ours.hidden_states) == len(want) == encoder.config.num_hidden_layers + 1
    assert all(h.dtype == torch.float32 for h in ours.hidden_states)
    assert torch.equal(ours.hidden_states[-1], ours.last_hidden)
    for got, expected in zip(ours.hidden_states, want, strict=True):
        assert F.cosine_similarity(got[0], expected[0], dim=-1).min().item() > 0.999
    assert ours.attentions[0].shape == (1, 12, ids.shape[1], ids.shape[1])


def test_a_hook_on_a_block_sees_its_call(bf16_encoder: Encoder) -> None:
    seen = []
    handle = bf16_encoder.model.layers[2].register_forward_hook(lambda module, args, out: seen.append(out[0].shape))
    try:
        hooked = bf16_encoder.encode(["a cat sat on the mat", "hello"])
    finally:
        handle.remove()
    assert seen == [torch.Size([2, 8, 384])]
    plain = bf16_encoder.encode(["a cat sat on the mat", "hello"])
    assert F.cosine_similarity(hooked, plain, dim=1).min().item() > 0.99999
