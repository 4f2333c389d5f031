"""`BertEncoder`: a BERT-family encoder whose attention is `qkv.MultiHeadAttention`.

    embeddings = LayerNorm(word[ids] + position[pos] + token_type[types])
    per block (post-LN, as in BERT):
        x = LayerNorm(x + MultiHeadAttention(x, mask))
        x = LayerNorm(x + W_out GELU(W_in x))           GELU = exact erf form

Dropout is left out: the encoder runs pretrained checkpoints for inference. Attention maps
and per-layer hidden states are returned by `forward` when asked, never kept on the module.

Shape legend (docs/design.md): B batch, L tokens, D model width, H heads, S key length (= L).

Reference: Devlin et al., "BERT" (2019), and the checkpoint layout of Hugging Face
``BertModel``, mapped key by key in `qkv.models.weights`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from qkv.masks import Mask
from qkv.models.config import BertConfig
from qkv.native import add_norm_bf16, onednn_linear
from qkv.native.machine import compute_dtype, note_computed_wide
from qkv.nn.multihead import MultiHeadAttention

__all__ = ["BertEmbeddings", "BertEncoder", "BertLayer", "EncoderOutput"]


@dataclass(frozen=True)
class EncoderOutput:
    """What `BertEncoder.forward` returns.

    - last_hidden: (B, L, D) output of the last block.
    - hidden_states: layers + 1 tensors (B, L, D), embeddings first; () unless asked.
    - attentions: layers tensors (B, H, L, L) of exact probabilities; () unless asked.
    """

    last_hidden: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] = ()
    attentions: tuple[torch.Tensor, ...] = ()


class BertEmbeddings(nn.Module):
    """Sum of word, absolute position and token-type embeddings, then LayerNorm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        D = config.hidden_size
        self.word = nn.Embedding(config.vocab_size, D)
        self.position = nn.Embedding(config.max_position_embeddings, D)
        self.token_type = nn.Embedding(config.type_vocab_size, D)
        self.norm = nn.LayerNorm(D, eps=config.layer_norm_eps)

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor
    ) -> torch.Tensor:
        """ids, positions, token_types: (B, L) int64 -> (B, L, D)."""
        x = self.word(ids) + self.position(positions) + self.token_type(token_types)  # (B, L, D)
        return self.norm(x)


class BertLayer(nn.Module):
    """One post-LayerNorm encoder block: attention sublayer, then feed-forward sublayer."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        D, eps = config.hidden_size, config.layer_norm_eps
        self.attention = MultiHeadAttention(D, config.num_attention_heads)
        self.attention_norm = nn.LayerNorm(D, eps=eps)
        self.ffn_in = nn.Linear(D, config.intermediate_size)
        self.ffn_out = nn.Linear(config.intermediate_size, D)
        self.ffn_norm = nn.LayerNorm(D, eps=eps)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | Mask | None, return_weights: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, L, D) -> (x (B, L, D), weights (B, H, L, L) or None)."""
        x, _, weights = self.step(x, None, mask, return_weights)
        return x, weights

    def step(
        self, x: torch.Tensor, x_low: torch.Tensor | None, mask: torch.Tensor | Mask | None, return_weights: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x (B, L, D), and x_low, x in the matmul dtype or None (then cast here) ->
        (x (B, L, D), x_low (B, L, D), weights (B, H, L, L) or None).

        The matrix multiplies run in the dtype of the linear weights; the residual stream and
        the LayerNorms keep theirs (float32 after `BertEncoder.set_matmul_dtype`): the sums
        x + sublayer(x) promote to the wider of the two. Each sublayer ends with the residual
        stream and its copy in the matmul dtype, the next product's input (one pass in
        bf16 inference: `qkv.native.add_norm_bf16`). Where this CPU only emulates the matmul
        dtype's products the whole block runs in float32 (`_step_float32`).
        """
        matmul_dtype = self.ffn_in.weight.dtype
        if x.dtype == compute_dtype(matmul_dtype, x.device) != matmul_dtype:
            # this CPU only emulates the matmul dtype's products: the block runs in float32 on
            # the residual stream itself, weights converted once (onednn_linear.wide_copy),
            # with no rounding of activations to the matmul dtype and back
            note_computed_wide(matmul_dtype, x.device)
            return self._step_float32(x, mask, return_weights)
        if x_low is None or x_low.dtype != matmul_dtype:  # the first block, or blocks of mixed dtypes
            x_low = x.to(matmul_dtype)  # (B, L, D)
        weights = None
        if return_weights:
            mixed, weights = self.attention(x_low, mask=mask, return_weights=True)  # (B, L, D), (B, H, L, L)
        else:
            mixed = self.attention(x_low, mask=mask)  # (B, L, D)
        x, x_low = add_norm_bf16.add_norm(x, mixed, self.attention_norm, matmul_dtype)  # (B, L, D) twice
        # bf16 inference: bias and GELU in the product's epilogue (qkv.native.onednn_linear)
        hidden = onednn_linear.run_gelu(self.ffn_in, x_low)  # (B, L, intermediate)
        x, x_low = add_norm_bf16.add_norm(x, onednn_linear.run(self.ffn_out, hidden), self.ffn_norm, matmul_dtype)  # (B, L, D)
        return x, x_low, weights

    def _step_float32(
        self, x: torch.Tensor, mask: torch.Tensor | Mask | None, return_weights: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`step` where the matmul dtype's products are emulated: x (B, L, D) float32 ->
        (x, x (the next block's input, float32 too), weights or None)."""
        if onednn_linear.hooked(self.attention):  # a hook must see the module's call, in its dtype
            low = self.attention.q_proj.weight.dtype
            result = self.attention(x.to(low), mask=mask, return_weights=return_weights)
            mixed, weights = result if isinstance(result, tuple) else (result, None)
            mixed = mixed.to(x.dtype)  # (B, L, D)
        else:
            mixed, weights = self.attention.forward_float32(x, mask=mask, return_weights=return_weights)  # (B, L, D)
        x = self.attention_norm(x + mixed)  # (B, L, D)
        hidden = onednn_linear.run_wide(self.ffn_in, x, gelu=True)  # (B, L, intermediate)
        x = self.ffn_norm(x + onednn_linear.run_wide(self.ffn_out, hidden))  # (B, L, D)
        return x, x, weights


class BertEncoder(nn.Module):
    """Embeddings and ``num_hidden_layers`` post-LN blocks; no pooler (mean pooling is done
    by `qkv.models.Encoder`)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    @property
    def blocks(self) -> list[BertLayer]:
        """The layers, typed as what they are (an nn.ModuleList yields plain Modules to a type checker)."""
        return [cast(BertLayer, layer) for layer in self.layers]

    @property
    def matmul_dtype(self) -> torch.dtype:
        """The dtype of the linear layers' weights, in which the matrix multiplies run."""
        return self.blocks[0].ffn_in.weight.dtype if len(self.layers) else self.embeddings.word.weight.dtype

    def set_matmul_dtype(self, dtype: torch.dtype) -> BertEncoder:
        """Mixed precision: the linear layers (attention projections, feed-forward) in
        ``dtype``; embeddings, LayerNorms and the residual stream stay as they are (float32).

        Rounding the residual stream to bfloat16 after every block costs accuracy (mean-pooled
        embeddings drift to a cosine of about 0.9998 against float32) and buys little speed:
        the matrix multiplies are the work. Returns self.
        """
        for layer in self.layers:
            layer.attention.to(dtype)
            layer.ffn_in.to(dtype)
            layer.ffn_out.to(dtype)
        return self

    def forward(
        self,
        ids: torch.Tensor,
        *,
        valid: torch.Tensor | None = None,
        mask: torch.Tensor | Mask | None = None,
        positions: torch.Tensor | None = None,
        token_types: torch.Tensor | None = None,
        return_weights: bool = False,
        return_hidden: bool = False,
    ) -> EncoderOutput:
        """Run the encoder.

        Args:
            ids: (B, L) token ids.
            valid: (B, L) bool, True for real tokens and False for padding; becomes the
                key-padding mask (B, 1, 1, L). Padded query rows are computed but meaningless.
            mask: instead of ``valid``, any attention mask `qkv.attention` takes (e.g.
                ``qkv.masks.documents(ids)`` for several texts packed into one row).
            positions: (B, L) position ids; default 0 .. L-1 in every row.
            token_types: (B, L) segment ids; default 0.
            return_weights: also return every layer's attention probabilities (B, H, L, L).
            return_hidden: also return the embeddings and every layer's output (B, L, D).
        """
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype != torch.int64:
            got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"ids must be an int64 tensor (B, L), got {got}")
        B, length = ids.shape
        limit = self.config.max_position_embeddings
        if positions is None:
            if length > limit:
                raise ValueError(f"sequence of {length} tokens is longer than the model's {limit} positions")
            positions = torch.arange(length, device=ids.device).expand(B, length)  # (B, L)
        elif positions.shape != ids.shape or int(positions.max()) >= limit:
            raise ValueError(f"positions must be (B, L) = {tuple(ids.shape)} below {limit}, got {tuple(positions.shape)}")
        if token_types is None:
            token_types = torch.zeros_like(ids)  # (B, L)
        if valid is not None and mask is not None:
            raise ValueError("pass either valid (key padding) or mask, not both")
        if valid is not None:
            if valid.shape != ids.shape or valid.dtype != torch.bool:
                raise ValueError(f"valid must be a bool tensor {tuple(ids.shape)}, got {tuple(valid.shape)} {valid.dtype}")
            mask = valid[:, None, None, :]  # (B, 1, 1, L)

        x = self.embeddings(ids, positions, token_types)  # (B, L, D)
        hidden_states, attentions = [x], []
        x_low = None  # x in the matmul dtype, handed from block to block
        for layer in self.blocks:
            if onednn_linear.hooked(layer):  # a hook on the block must see its call
                (x, weights), x_low = layer(x, mask, return_weights), None
            else:
                x, x_low, weights = layer.step(x, x_low, mask, return_weights)
            hidden_states.append(x)
            attentions.append(weights)
        return EncoderOutput(
            last_hidden=x,
            hidden_states=tuple(hidden_states) if return_hidden else (),
            attentions=tuple(attentions) if return_weights else (),
        )
