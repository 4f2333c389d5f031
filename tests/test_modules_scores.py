"""MultiHeadAttention with a position bias (ALiBi, T5 relative) and a softcap: against the
float64 reference, across KV-cache steps, and batched decoding of prompts of different lengths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from qkv import reference as R


def _alibi_by_hand(H: int, L: int, S: int) -> np.ndarray:
    slopes = np.array([2.0 ** (-8 * (h + 1) / H) for h in range(H)])  # H a power of two
    p = np.arange(L)[:, None] + S - L
    return -slopes[:, None, None] * np.abs(p - np.arange(S)[None, :])  # (H, L, S)


def test_module_with_alibi_and_softcap_matches_the_reference() -> None:
    torch.manual_seed(0)
    D, H, L = 32, 4, 9
    mha = qkv.MultiHeadAttention(D, H, position_bias=qkv.bias.alibi(), softcap=3.0).double()
    x = torch.randn(2, L, D, dtype=torch.float64)
    out = mha(x, mask=qkv.masks.causal())
    w = {name: p.detach().numpy() for name, p in mha.named_parameters()}
    xn = x.numpy()

    def heads(name: str) -> np.ndarray:
        y = xn @ w[f"{name}.weight"].T + w[f"{name}.bias"]  # (B, L, H*E)
        return y.reshape(2, L, H, -1).transpose(0, 2, 1, 3)  # (B, H, L, E)

    causal = np.tril(np.ones((L, L), dtype=bool))
    trace = R.attention(heads("q_proj"), heads("k_proj"), heads("v_proj"), causal, bias=_alibi_by_hand(H, L, L), softcap=3.0)
    concat = trace.output.transpose(0, 2, 1, 3).reshape(2, L, -1)  # (B, L, H*Ev)
    expected = concat @ w["out_proj.weight"].T + w["out_proj.bias"]
    np.testing.assert_allclose(out.detach().numpy(), expected, atol=1e-10)


@pytest.mark.parametrize("kind", ["alibi", "relative"])
def test_cache_steps_continue_the_positions(kind: str) -> None:
    torch.manual_seed(1)
    D, H = 16, 4
    bias = qkv.bias.alibi() if kind == "alibi" else qkv.bias.relative(torch.nn.Parameter(torch.randn(H, 32)), bidirectional=False)
    mha = qkv.MultiHeadAttention(D, H, num_kv_heads=2, position_bias=bias).double().eval()
    x = torch.randn(2, 12, D, dtype=torch.float64)
    with torch.no_grad():
        full = mha(x, mask=qkv.masks.causal())
        cache = mha.new_cache(2, 12)
        steps = [mha(x[:, :5], mask=qkv.masks.causal(), cache=cache)]
        steps += [mha(x[:, t : t + 1], mask=qkv.masks.causal(), cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-12, rtol=0)


def test_batched_decoding_of_different_prompt_lengths_equals_decoding_each_alone() -> None:
    torch.manual_seed(2)
    D, H, steps = 16, 4, 4
    table = torch.nn.Parameter(torch.randn(H, 32))
    mha = qkv.MultiHeadAttention(
        D, H, position_bias=qkv.bias.alibi() + qkv.bias.relative(table, bidirectional=False), softcap=5.0
    ).double().eval()
    lengths = [3, 7]
    prompts = [torch.randn(1, n, D, dtype=torch.float64) for n in lengths]
    new_tokens = torch.randn(2, steps, D, dtype=torch.float64)

    def decode_alone(i: int) -> torch.Tensor:
        cache = mha.new_cache(1, lengths[i] + steps)
        outs = [mha(prompts[i], mask=qkv.masks.causal(), cache=cache)[:, -1:]]
        outs += [mha(new_tokens[i : i + 1, t : t + 1], mask=qkv.masks.causal(), cache=cache) for t in range(steps)]
        return torch.cat(outs, dim=1)  # (1, 1 + steps, D)

    with torch.no_grad():
        alone = torch.cat([decode_alone(0), decode_alone(1)])
        # together: left-pad the short prompt, hide the padding with a key-padding mask
        P = max(lengths)
        batch = torch.zeros(2, P, D, dtype=torch.float64)
        valid = torch.zeros(2, P + steps, dtype=torch.bool)
        for i, (n, prompt) in enumerate(zip(lengths, prompts, strict=True)):
            batch[i, P - n :] = prompt[0]
            valid[i, P - n :] = True
        cache = mha.new_cache(2, P + steps)
        outs = [mha(batch, mask=qkv.masks.causal() & qkv.masks.key_padding(valid[:, :P]), cache=cache)[:, -1:]]
        for t in range(steps):
            S = P + t + 1
            outs.append(mha(new_tokens[:, t : t + 1], mask=qkv.masks.key_padding(valid[:, :S]), cache=cache))
        together = torch.cat(outs, dim=1)
    torch.testing.assert_close(together, alone, atol=1e-12, rtol=0)


def test_the_bias_tensors_are_the_modules() -> None:
    table = torch.nn.Parameter(torch.zeros(4, 32))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    mha = qkv.MultiHeadAttention(16, 4, position_bias=qkv.bias.relative(table) + qkv.bias.alibi(slopes))
    assert dict(mha.named_parameters())["position_bias_0"] is table
    assert "position_bias_1" in dict(mha.named_buffers())
    mha.double()
    assert mha.position_bias_1.dtype == torch.float64  # the buffer followed .to()
    out = mha(torch.randn(2, 300, 16, dtype=torch.float64), mask=qkv.masks.sliding_window(64))  # the block engine
    out.square().sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0
    assert "position_bias=relative(4 heads" in repr(mha)
    with pytest.raises(TypeError, match=r"position_bias must be a qkv\.bias"):
        qkv.MultiHeadAttention(16, 4, position_bias=torch.zeros(4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not fit num_heads=4"):
        qkv.MultiHeadAttention(16, 4, position_bias=qkv.bias.alibi(torch.ones(2)))
    with pytest.raises(ValueError, match="softcap"):
        qkv.MultiHeadAttention(16, 4, softcap=0.0)
