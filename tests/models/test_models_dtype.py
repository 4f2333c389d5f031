"""The encoder in bfloat16: `load_encoder(dtype=...)`, a model cast by hand, and autocast.

Expected values: qkv's own float32 embeddings, which `test_models_encoder` checks against
sentence-transformers, and sentence-transformers itself for texts it does not cut (<= 256
tokens). The bar is a cosine of 0.9999 per text (the issue's goal) for the mixed-precision
encoder that `load_encoder(dtype=torch.bfloat16)` builds.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F

from qkv.models import Encoder, load_encoder

# The bar of the mixed-precision encoder; measured 0.99994 on these texts.
MIN_COSINE = 0.9999


def _varied_texts(encoder: Encoder) -> list[str]:
    """Texts of 3 to about 510 tokens of whole vocabulary words, plus a few natural ones."""
    vocab = sorted(w for w in encoder.tokenizer._tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 2)
    rng = random.Random(0)
    words = [1, 8, 40, 300, 508]
    texts = [" ".join(rng.choice(vocab) for _ in range(n)) for n in words]
    return [*texts, "The trophy did not fit into the suitcase because it was too big.", "苹果 发布 手机", "ok"]


@pytest.fixture(scope="module")
def bf16_encoder() -> Encoder:
    return load_encoder(dtype=torch.bfloat16)


def test_bfloat16_embeddings_match_float32(encoder: Encoder, bf16_encoder: Encoder) -> None:
    texts = _varied_texts(encoder)
    lengths = encoder.tokenizer.lengths(texts)
    assert max(lengths) > 500 and any(256 < n < 400 for n in lengths)  # long texts are really there
    want = encoder.encode(texts)
    for packed in (False, True):
        got = bf16_encoder.encode(texts, packed=packed)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert F.cosine_similarity(got, want, dim=1).min().item() >= MIN_COSINE
    assert bf16_encoder.dtype == torch.bfloat16 and encoder.dtype == torch.float32
    assert "dtype=bfloat16" in repr(bf16_encoder)


def test_bfloat16_embeddings_match_sentence_transformers(bf16_encoder: Encoder, st_model) -> None:
    texts = ["A man is playing a guitar.", "I sat on the bank of the river.", "hi"]
    want = st_model.encode(texts, convert_to_tensor=True)
    got = bf16_encoder.encode(texts)
    assert F.cosine_similarity(got, want, dim=1).min().item() >= MIN_COSINE


def test_mixed_precision_keeps_layernorms_and_embeddings_float32(bf16_encoder: Encoder) -> None:
    model = bf16_encoder.model
    assert model.embeddings.word.weight.dtype == torch.float32
    for layer in model.layers:
        assert layer.attention_norm.weight.dtype == torch.float32
        assert layer.ffn_in.weight.dtype == torch.bfloat16
        assert layer.attention.q_proj.weight.dtype == torch.bfloat16
    inspection = bf16_encoder.inspect("The cat sat on the mat.")
    assert inspection.attentions.dtype == torch.float32
    torch.testing.assert_close(inspection.attentions.sum(-1), torch.ones(inspection.attentions.shape[:-1]))


def test_a_model_cast_whole_to_bfloat16_encodes(encoder: Encoder) -> None:
    # casting every parameter (the residual stream too) used to fail inside encode
    cast = copy.deepcopy(encoder)
    cast.model.to(torch.bfloat16)
    texts = _varied_texts(encoder)[:3]
    got = cast.encode(texts)
    assert got.dtype == torch.float32
    # measured 0.99985: rounding the residual stream costs a little, as set_matmul_dtype says
    assert F.cosine_similarity(got, encoder.encode(texts), dim=1).min().item() >= 0.999


def test_autocast_encodes(encoder: Encoder) -> None:
    texts = _varied_texts(encoder)[:3]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = encoder.encode(texts)
    assert got.dtype == torch.float32
    assert F.cosine_similarity(got, encoder.encode(texts), dim=1).min().item() >= MIN_COSINE


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int8, "bfloat16"])
def test_unsupported_dtypes_are_refused(dtype: object) -> None:
    with pytest.raises(TypeError, match=r"dtype must be one of torch\.float32, torch\.bfloat16"):
        load_encoder(dtype=dtype)  # type: ignore[arg-type]


def test_blocks_of_different_matmul_dtypes_encode() -> None:
    # one block in bf16, the others float32 (a hand-made mixed model): each block must get the
    # residual stream in its own matmul dtype, not the previous block's copy
    from qkv.models.bert import BertEncoder
    from qkv.models.config import BertConfig

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16)
    model = BertEncoder(config).eval()
    reference = copy.deepcopy(model)
    for layer in model.layers[1:2]:
        for part in (layer.attention, layer.ffn_in, layer.ffn_out):
            part.to(torch.bfloat16)
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        got = model(ids).last_hidden
        want = reference(ids).last_hidden
    assert got.dtype == torch.float32
    assert F.cosine_similarity(got.flatten(1), want.flatten(1)).min().item() > 0.999
