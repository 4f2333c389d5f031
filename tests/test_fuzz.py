"""Differential fuzzing: every path against a float64 oracle, forward and backward.

Each example draws a problem (shapes, dtype, grouped heads), a mask of any kind (none, bool,
float with extreme finite values and -inf, every `qkv.masks` family, combinations), rows with
no visible key, NaN / inf positions in q, k or v, which inputs require grad, a backend and
return_lse / return_weights. The expected values come from a float64 formula written here
(plain torch ops, independent of qkv's kernels) and are tied to `qkv.reference` once; the
NaN rule of `qkv.attention`'s docstring is re-derived here from the inputs.

Tolerance (docs/design.md): the error of the path against float64 is at most 2x (forward) / 3x
(gradients) the error of a naive implementation in the same dtype, plus a floor scaled by the
size of the values. The naive implementation adds the mask in float32 or wider, as docs/design.md
requires of every path; when it overflows itself, the math path's error is the yardstick.

A second property draws score terms (learnable ALiBi slopes, a relative table, a dense bias
hiding rows and runs of keys, a softcap) with scales of any sign and size, grouped heads,
windows and odd head dims, the block engine on tiles small enough to merge pieces of each row;
its oracle is the same kind of float64 formula, tied to `qkv.reference` once.

Profiles: HYPOTHESIS_PROFILE=ci (default, 200 examples) or thorough (3000 examples).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from unittest import mock

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkv
from qkv import masks as M
from qkv import reference as R
from qkv.attention import dispatch
from qkv.backends.blocks.planner import BlockConfig

settings.register_profile(
    "ci", max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-3, torch.float16: 5e-4}
# finite mask values that break a mask rounded to float16 / bfloat16, or that dwarf the scores
EXTREME = [7e4, -7e4, 1e5, -1e5, -1e9, 3.3e4, -60.0, 12.5, -3.0e3]
_SCORE_BOUND = 0.0  # max |scale q_i . k_j| of the current example (Cauchy-Schwarz bound)
MASK_KINDS = [
    "none", "bool", "float", "causal", "causal-top-left", "window", "prefix", "documents",
    "documents-unsorted", "key-padding", "combined", "predicate", "dense",
]


@dataclass
class Example:
    dtype: torch.dtype
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: object
    visible: torch.Tensor  # (B | 1, H | 1, L, S) bool: the mask as the oracle sees it
    additive: torch.Tensor | None  # (B | 1, H | 1, L, S) float64 added to the scores, or None
    scale: float | None
    grad: tuple[bool, bool, bool]
    backend: str
    return_lse: bool
    return_weights: bool

    def _repr_pretty_(self, printer, cycle) -> None:  # type: ignore[no-untyped-def]  # hypothesis' printer
        printer.text(repr(self))

    def __repr__(self) -> str:  # a falsifying example in one line, not pages of tensors
        bad = {n: torch.nonzero(~torch.isfinite(t)).tolist() for n, t in (("q", self.q), ("k", self.k), ("v", self.v))}
        if isinstance(self.mask, torch.Tensor):
            finite = self.mask[torch.isfinite(self.mask)] if self.mask.is_floating_point() else self.mask
            mask = f"{self.mask.dtype} {tuple(self.mask.shape)}"
            if self.mask.is_floating_point() and finite.numel():
                mask += f" range [{float(finite.min()):.3g}, {float(finite.max()):.3g}]"
            mask += f", empty rows {int((~self.visible.any(-1)).sum())}"
        else:
            mask = "None" if self.mask is None else self.mask.describe()
        return (
            f"Example({str(self.dtype).removeprefix('torch.')}, q {tuple(self.q.shape)}, k {tuple(self.k.shape)}, "
            f"v {tuple(self.v.shape)}, mask {mask}, non-finite {bad}, scale {self.scale}, grad {self.grad}, "
            f"backend {self.backend!r}, lse {self.return_lse}, weights {self.return_weights})"
        )


def _structured_mask(kind: str, B: int, L: int, S: int, gen: torch.Generator) -> M.Mask:
    if kind == "causal":
        return M.causal()
    if kind == "causal-top-left":
        return M.causal(align="top-left")
    if kind == "window":
        return M.sliding_window(int(torch.randint(0, 4, (1,), generator=gen)), int(torch.randint(0, 3, (1,), generator=gen)))
    if kind == "prefix":
        return M.prefix_lm(int(torch.randint(0, S + 1, (1,), generator=gen)))
    if kind.startswith("documents"):
        ids = torch.sort(torch.randint(0, 3, (B, S), generator=gen), dim=1).values
        if kind == "documents-unsorted":
            ids = torch.randint(0, 3, (B, S), generator=gen)
        q_ids = torch.randint(0, 3, (B, L), generator=gen)
        return M.documents(q_ids, ids)
    if kind == "key-padding":
        return M.key_padding(torch.randint(0, S + 1, (B,), generator=gen))
    if kind == "combined":
        return M.sliding_window(2) & M.key_padding(torch.randint(0, S + 1, (B,), generator=gen)) | M.prefix_lm(1)
    if kind == "predicate":
        return M.predicate(lambda b, h, q, k: (q + k) % 3 != 1)
    assert kind == "dense"
    return M.dense(torch.rand(B, 1, L, S, generator=gen) > 0.4)


@st.composite
def examples(draw: st.DrawFn) -> Example:
    dtype = DTYPES[draw(st.sampled_from(list(DTYPES)))]
    B = draw(st.integers(1, 2))
    G = draw(st.integers(1, 2))
    H = G * draw(st.integers(1, 2))
    L, S = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    E, Ev = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    magnitude = draw(st.sampled_from([1.0, 3.0]))
    q = torch.randn(B, H, L, E, generator=gen, dtype=torch.float64) * magnitude
    k = torch.randn(B, G, S, E, generator=gen, dtype=torch.float64) * magnitude
    v = torch.randn(B, G, S, Ev, generator=gen, dtype=torch.float64)
    for name in draw(st.lists(st.sampled_from(["q", "k", "v"]), max_size=2)):
        t = {"q": q, "k": k, "v": v}[name]
        flat = t.view(-1)
        flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    q, k, v = (t.to(dtype) for t in (q, k, v))

    kind = draw(st.sampled_from(MASK_KINDS))
    additive = None
    if kind == "none":
        mask, visible = None, torch.ones(1, 1, L, S, dtype=torch.bool)
    elif kind == "bool":
        visible = torch.rand(B, 1, L, S, generator=gen) > draw(st.sampled_from([0.2, 0.6]))
        if draw(st.booleans()):
            visible[..., 0, :] = False  # a row with no visible key
        mask = visible
    elif kind == "float":
        values = torch.randn(1, H, L, S, generator=gen, dtype=torch.float64) * 2
        for _ in range(draw(st.integers(0, 4))):
            i, j = draw(st.integers(0, L - 1)), draw(st.integers(0, S - 1))
            values[0, :, i, j] = draw(st.sampled_from(EXTREME))
        if draw(st.booleans()):
            values[0, :, draw(st.integers(0, L - 1)), :] = draw(st.sampled_from([-1e5, -1e9, 7e4]))  # a whole row
        hidden = torch.rand(1, H, L, S, generator=gen) < draw(st.sampled_from([0.0, 0.3]))
        if draw(st.booleans()):
            hidden[..., -1, :] = True  # a row with no visible key
        values = values.float().double().masked_fill(hidden, float("-inf"))  # exactly float32 values
        mask, visible, additive = values.float(), ~hidden, values.masked_fill(hidden, 0.0)
    else:
        mask = _structured_mask(kind, B, L, S, gen)
        visible = mask.to_dense(L, S)

    grad = (draw(st.booleans()), draw(st.booleans()), draw(st.booleans()))
    backends = ["auto", "fused", "math"] + (["blocks"] if mask is None or isinstance(mask, M.Mask) else [])
    backend = draw(st.sampled_from(backends))
    scale = draw(st.sampled_from([None, None, 0.5, -1.3, 2.0, -1e-30, 0.0]))
    return Example(dtype, q, k, v, mask, visible, additive, scale, grad, backend, draw(st.booleans()), draw(st.booleans()))


def _formula(ex: Example, q, k, v, acc: torch.dtype):  # type: ignore[no-untyped-def]
    """softmax(scale q k^T + mask) v with the empty-row rule, every step in ``acc`` (the mask in
    float32 or wider): the oracle in float64, the naive yardstick in the input dtype."""
    H, G, E = q.shape[1], k.shape[1], q.shape[-1]
    k_, v_ = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)  # (B, H, S, *)
    scale = E**-0.5 if ex.scale is None else ex.scale
    scores = (q.to(acc) @ k_.to(acc).transpose(-1, -2)) * scale  # (B, H, L, S)
    wide = torch.promote_types(acc, torch.float32)
    scores = scores.to(wide)
    if ex.additive is not None:
        scores = scores + ex.additive.to(wide)
    scores = scores.masked_fill(~ex.visible, float("-inf"))
    empty = ~ex.visible.any(dim=-1, keepdim=True)  # (B | 1, H | 1, L, 1)
    safe = scores.masked_fill(empty, 0.0)
    weights = torch.softmax(safe.to(acc), dim=-1).masked_fill(empty, 0.0)
    lse = torch.logsumexp(safe, dim=-1).masked_fill(empty.squeeze(-1), float("-inf"))
    return weights.to(acc) @ v_.to(acc), weights, lse


def _affected(ex: Example) -> torch.Tensor:
    """The NaN rule: rows whose query is non-finite, or that see a key with a non-finite k or v."""
    H, G = ex.q.shape[1], ex.k.shape[1]
    bad_q = ~torch.isfinite(ex.q).all(dim=-1)  # (B, H, L)
    bad_kv = ~(torch.isfinite(ex.k).all(dim=-1) & torch.isfinite(ex.v).all(dim=-1))  # (B, G, S)
    bad_kv = bad_kv.repeat_interleave(H // G, dim=1)[:, :, None, :]  # (B, H, 1, S)
    return bad_q | (ex.visible & bad_kv).any(dim=-1)


def _run(fn, inputs, grad, d_out, d_lse, d_w, keep):  # type: ignore[no-untyped-def]
    """Forward, then backward of sum(out * d_out) + sum(lse * d_lse) + sum(weights * d_w) over kept rows."""
    leaves = [t.detach().clone().requires_grad_(g) for t, g in zip(inputs, grad, strict=True)]
    out, weights, lse = fn(*leaves)
    grads: list[torch.Tensor | None] = [None, None, None]
    if any(grad):
        loss = (out.double().masked_fill(~keep[..., None], 0.0) * d_out).sum()
        if lse is not None and d_lse is not None:
            loss = loss + (lse.double().masked_fill(~keep, 0.0).nan_to_num(neginf=0.0) * d_lse).sum()
        if weights is not None and d_w is not None:
            loss = loss + (weights.double().masked_fill(~keep[..., None], 0.0) * d_w).sum()
        if loss.requires_grad:
            loss.backward()
            grads = [t.grad.double() if t.grad is not None else torch.zeros_like(t, dtype=torch.float64) if g else None
                     for t, g in zip(leaves, grad, strict=True)]
    detach = lambda t: None if t is None else t.detach().double()  # noqa: E731
    return detach(out), detach(weights), detach(lse), grads


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    finite = torch.isfinite(want)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf (empty rows) differ"
    return float((got[finite] - want[finite]).abs().max()) if finite.any() else 0.0


def _check(name: str, got, want, naive, math, factor: float, floor: float) -> None:  # type: ignore[no-untyped-def]
    err_naive = _err(naive, want) if torch.isfinite(naive[torch.isfinite(want)]).all() else float("inf")
    yardstick = err_naive if err_naive != float("inf") else _err(math, want)
    scale = max(1.0, float(want[torch.isfinite(want)].abs().max()) if torch.isfinite(want).any() else 1.0)
    # rounding a score s costs eps * |s| in exp(s): the floor grows with the largest score
    scale *= 1.0 + _SCORE_BOUND
    err = _err(got, want)
    assert err <= factor * yardstick + floor * scale, (
        f"{name}: error {err:.3g} > {factor} x yardstick {yardstick:.3g} + {floor * scale:.3g}"
    )


@PROFILE
@given(ex=examples())
def test_every_path_agrees_with_float64(ex: Example) -> None:
    affected = _affected(ex)  # (B, H, L)
    keep = ~affected
    B, H, L = affected.shape
    S, Ev = ex.k.shape[2], ex.v.shape[3]
    gen = torch.Generator().manual_seed(1)
    d_out = torch.randn(B, H, L, Ev, generator=gen, dtype=torch.float64)
    d_lse = torch.randn(B, H, L, generator=gen, dtype=torch.float64) if ex.return_lse else None
    d_w = torch.randn(B, H, L, S, generator=gen, dtype=torch.float64) if ex.return_weights else None
    # the finite problem (non-finite entries as 0) is what unaffected rows must equal
    clean = [torch.where(torch.isfinite(t), t, torch.zeros((), dtype=t.dtype)) for t in (ex.q, ex.k, ex.v)]
    cleaned64 = [t.double() for t in clean]
    global _SCORE_BOUND
    factor = abs(ex.q.shape[-1] ** -0.5 if ex.scale is None else ex.scale)
    _SCORE_BOUND = factor * float(cleaned64[0].norm(dim=-1).max()) * float(cleaned64[1].norm(dim=-1).max())

    def path(q, k, v, backend=ex.backend):  # type: ignore[no-untyped-def]
        result = qkv.attention(q, k, v, ex.mask, scale=ex.scale, backend=backend,
                               return_lse=ex.return_lse, return_weights=ex.return_weights)
        parts = list(result) if isinstance(result, tuple) else [result]
        out = parts.pop(0)
        weights = parts.pop(0) if ex.return_weights else None
        lse = parts.pop(0) if ex.return_lse else None
        return out, weights, lse

    got = _run(path, (ex.q, ex.k, ex.v), ex.grad, d_out, d_lse, d_w, keep)
    want = _run(lambda q, k, v: _formula(ex, q, k, v, torch.float64), cleaned64, ex.grad, d_out, d_lse, d_w, keep)
    naive = _run(lambda q, k, v: _formula(ex, q, k, v, ex.dtype), clean, ex.grad, d_out, d_lse, d_w, keep)
    math = _run(lambda q, k, v: path(q, k, v, "math"), clean, ex.grad, d_out, d_lse, d_w, keep)

    # the NaN rule: exactly the affected rows are NaN, every other value is a number
    out = got[0]
    assert torch.equal(torch.isnan(out).any(dim=-1), affected), "NaN rows differ from the documented rule"
    assert torch.isnan(out[affected]).all()
    if ex.return_lse:
        assert torch.equal(torch.isnan(got[2]), affected)
    if ex.return_weights:
        assert torch.equal(torch.isnan(got[1]).any(dim=-1), affected)

    floor = FLOOR[ex.dtype]
    k_out = keep[..., None].expand_as(out)
    _check("output", out[k_out], want[0][k_out], naive[0][k_out], math[0][k_out], 2, floor)
    if ex.return_weights:
        k_w = keep[..., None].expand_as(got[1])
        _check("weights", got[1][k_w], want[1][k_w], naive[1][k_w], math[1][k_w], 2, floor)
    if ex.return_lse:
        _check("lse", got[2][keep], want[2][keep], naive[2][keep], math[2][keep], 2, floor)
    for i, name in enumerate(("dq", "dk", "dv")):
        if ex.grad[i] and want[3][i] is not None:
            assert got[3][i] is not None and torch.isfinite(got[3][i]).all(), f"{name} is missing or not finite"
            _check(name, got[3][i], want[3][i], naive[3][i], math[3][i], 3, floor)


def test_the_oracle_is_the_reference() -> None:
    """The float64 formula of this file equals `qkv.reference` (NumPy) on a masked problem."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 2, 5, 4, generator=gen), torch.randn(2, 1, 6, 4, generator=gen), torch.randn(2, 1, 6, 3, generator=gen)
    hidden = torch.rand(1, 2, 5, 6, generator=gen) < 0.3
    hidden[..., 1, :] = True
    values = torch.randn(1, 2, 5, 6, generator=gen, dtype=torch.float64)
    ex = Example(torch.float64, q, k, v, None, ~hidden, values.masked_fill(hidden, 0.0), 0.7, (False,) * 3, "math", True, True)
    out, weights, lse = _formula(ex, q.double(), k.double(), v.double(), torch.float64)
    trace = R.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), values.masked_fill(hidden, float("-inf")).numpy(), 0.7)
    np.testing.assert_allclose(out.numpy(), trace.output, atol=1e-12)
    np.testing.assert_allclose(weights.numpy(), trace.weights, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse.numpy()), np.isneginf(trace.lse))
    np.testing.assert_allclose(lse.numpy()[np.isfinite(trace.lse)], trace.lse[np.isfinite(trace.lse)], atol=1e-12)


# Score terms -------------------------------------------------------------------------------------
# Scales of any sign and size, grouped heads, windows, odd head dims and learnable bias tensors
# (ALiBi slopes, a T5-style table, a dense bias that hides rows and runs of keys with -inf,
# finfo.min or -1e20), with and without a softcap. The block engine runs on tiles small enough
# that these short rows are cut into several pieces, so its merge is exercised.

TERM_SCALES = [None, -1.3, -1e-30, 1e-30, 0.0, 0.5]
TERM_MASKS = ["none", "causal", "causal-top-left", "window", "key-padding"]
HIDE = [float("-inf"), torch.finfo(torch.float32).min, -1e20]
# the relative table's buckets by hand: num_buckets=256, max_distance=512 (bidirectional) puts
# distances below 64 in buckets of their own, (j > p) * 128 + |j - p|; rows here are shorter
REL_BUCKETS, REL_MAX_DISTANCE = 256, 512
TINY_BLOCKS = BlockConfig(block_q=8, block_k=4, masked_span=8, min_rows=2, call_bytes=2**12)


@dataclass
class TermsExample:
    dtype: torch.dtype
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: M.Mask | None
    scale: float | None
    softcap: float | None
    kind: str  # "none", "alibi", "relative", "dense"
    param: torch.Tensor | None  # the bias tensor (float64 values), learnable
    backend: str

    def _repr_pretty_(self, printer, cycle) -> None:  # type: ignore[no-untyped-def]
        printer.text(repr(self))

    def __repr__(self) -> str:
        mask = "None" if self.mask is None else self.mask.describe()
        return (
            f"TermsExample({str(self.dtype).removeprefix('torch.')}, q {tuple(self.q.shape)}, k {tuple(self.k.shape)}, "
            f"v {tuple(self.v.shape)}, mask {mask}, scale {self.scale}, softcap {self.softcap}, bias {self.kind}, "
            f"backend {self.backend!r})"
        )


@st.composite
def terms_examples(draw: st.DrawFn) -> TermsExample:
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    B, G = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    H = G * draw(st.integers(1, 3))
    L, S = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    E, Ev = draw(st.sampled_from([1, 3, 5, 7, 8, 13])), draw(st.sampled_from([1, 4, 7, 9]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(B, H, L, E, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(B, G, S, E, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(B, G, S, Ev, generator=gen, dtype=torch.float64).to(dtype)
    kind = draw(st.sampled_from(TERM_MASKS))
    mask: M.Mask | None = None
    if kind == "causal":
        mask = M.causal()
    elif kind == "causal-top-left":
        mask = M.causal(align="top-left")
    elif kind == "window":
        mask = M.sliding_window(draw(st.integers(0, 12)), draw(st.integers(0, 4)))
    elif kind == "key-padding":
        mask = M.key_padding(torch.randint(0, S + 1, (B,), generator=gen))
    bias_kind = draw(st.sampled_from(["none", "alibi", "relative", "dense"]))
    param = None
    if bias_kind == "alibi":
        param = torch.randn(H, generator=gen, dtype=torch.float64) * 0.5  # negative slopes too
    elif bias_kind == "relative":
        param = torch.randn(H, REL_BUCKETS, generator=gen, dtype=torch.float64)
    elif bias_kind == "dense":
        param = torch.randn(B, 1, L, S, generator=gen, dtype=torch.float64)
        hide = draw(st.sampled_from(HIDE))
        if draw(st.booleans()):
            param[0, :, :, S // 3 :] = hide  # padding keys of batch row 0
        if draw(st.booleans()):
            param[-1, :, draw(st.integers(0, L - 1)), :] = hide  # a whole row
        param = param.float().double()  # exactly float32 values
    softcap = draw(st.sampled_from([None, None, 5.0]))
    backends = ["auto", "math", "blocks"] + (["fused"] if softcap is None else [])
    return TermsExample(dtype, q, k, v, mask, draw(st.sampled_from(TERM_SCALES)), softcap, bias_kind, param,
                        draw(st.sampled_from(backends)))


def _terms_bias(ex: TermsExample, param: torch.Tensor | None) -> object:
    """The bias as qkv takes it."""
    if ex.kind == "alibi":
        return qkv.bias.alibi(param)
    if ex.kind == "relative":
        return qkv.bias.relative(param, num_buckets=REL_BUCKETS, max_distance=REL_MAX_DISTANCE)
    return param


def _terms_formula(ex: TermsExample, q, k, v, param, acc: torch.dtype):  # type: ignore[no-untyped-def]
    """docs/design.md's score order in plain torch ops, every step in ``acc`` (float32 or wider)."""
    H, L, E = q.shape[1:]
    G, S = k.shape[1], k.shape[2]
    wide = torch.promote_types(acc, torch.float32)
    k_, v_ = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)  # (B, H, S, *)
    scale = E**-0.5 if ex.scale is None else ex.scale
    s = (q.to(wide) @ k_.to(wide).transpose(-1, -2)) * scale  # (B, H, L, S)
    if ex.softcap is not None:
        s = torch.tanh(s / ex.softcap) * ex.softcap
    p = torch.arange(L).view(L, 1) + (S - L)  # (L, 1): query positions, bottom-right
    j = torch.arange(S).view(1, S)  # (1, S)
    if ex.kind == "alibi":
        s = s - param.to(wide).view(1, H, 1, 1) * (p - j).abs().to(wide)
    elif ex.kind == "relative":
        bucket = (j > p).long() * (REL_BUCKETS // 2) + (j - p).abs()  # (L, S)
        s = s + param.to(wide)[:, bucket].unsqueeze(0)  # (1, H, L, S)
    elif ex.kind == "dense":
        s = s + param.to(wide)
    visible = torch.ones(1, 1, L, S, dtype=torch.bool) if ex.mask is None else ex.mask.to_dense(L, S)
    s = s.masked_fill(~visible, float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True).detach()
    empty = row_max == float("-inf")
    e = torch.exp(s - row_max.masked_fill(empty, 0.0))
    total = e.sum(dim=-1, keepdim=True)
    weights = e / total.masked_fill(empty, 1.0)
    lse = (total.masked_fill(empty, 1.0).log() + row_max.masked_fill(empty, 0.0)).masked_fill(empty, float("-inf"))
    return (weights.to(acc) @ v_.to(acc)).to(wide), lse.squeeze(-1)


@PROFILE
@given(ex=terms_examples())
def test_score_terms_on_every_path_agree_with_float64(ex: TermsExample) -> None:
    B, H, L = ex.q.shape[:3]
    Ev = ex.v.shape[3]
    gen = torch.Generator().manual_seed(2)
    d_out = torch.randn(B, H, L, Ev, generator=gen, dtype=torch.float64)
    d_lse = torch.randn(B, H, L, generator=gen, dtype=torch.float64)
    global _SCORE_BOUND
    q64, k64 = ex.q.double(), ex.k.double()
    factor = abs(ex.q.shape[-1] ** -0.5 if ex.scale is None else ex.scale)
    _SCORE_BOUND = factor * float(q64.norm(dim=-1).max()) * float(k64.norm(dim=-1).max())

    def run(fn, dtype):  # type: ignore[no-untyped-def]
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (ex.q, ex.k, ex.v)]
        param = None
        if ex.param is not None:
            param = ex.param.to(torch.float64 if dtype == torch.float64 else torch.float32).detach().requires_grad_(True)
        out, lse = fn(*leaves, param)
        finite = torch.isfinite(lse)
        loss = (out.double() * d_out).sum() + (lse.double().masked_fill(~finite, 0.0) * d_lse).sum()
        loss.backward()
        grads = [t.grad.double() for t in leaves] + ([param.grad.double()] if param is not None else [])
        return out.detach().double(), lse.detach().double(), grads

    def path(q, k, v, param, backend=ex.backend):  # type: ignore[no-untyped-def]
        with mock.patch.object(dispatch, "BLOCKS", TINY_BLOCKS):
            return qkv.attention(q, k, v, ex.mask, scale=ex.scale, bias=_terms_bias(ex, param), softcap=ex.softcap,
                                 backend=backend, return_lse=True)

    got = run(path, ex.dtype)
    want = run(lambda q, k, v, p: _terms_formula(ex, q, k, v, p, torch.float64), torch.float64)
    naive = run(lambda q, k, v, p: _terms_formula(ex, q, k, v, p, ex.dtype), ex.dtype)
    math = run(lambda q, k, v, p: path(q, k, v, p, "math"), ex.dtype)
    assert not torch.isnan(got[0]).any(), "finite inputs gave NaN"
    floor = FLOOR[ex.dtype]
    _check("output", got[0], want[0], naive[0], math[0], 2, floor)
    _check("lse", got[1], want[1], naive[1], math[1], 2, floor)
    for name, g, w, n, m in zip(("dq", "dk", "dv", "dbias"), got[2], want[2], naive[2], math[2], strict=False):
        assert torch.isfinite(g).all(), f"{name} is not finite"
        _check(name, g, w, n, m, 3, floor)


def test_the_score_terms_oracle_is_the_reference() -> None:
    """`_terms_formula` in float64 equals `qkv.reference` given the bias by hand (ALiBi, the
    table's buckets, a dense bias hiding a key) and a softcap."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, n, 3, generator=gen, dtype=torch.float64) for n in (5, 7, 7))
    p, j = np.arange(5)[:, None] + 2, np.arange(7)[None, :]
    slopes, table = torch.tensor([0.3, -0.2], dtype=torch.float64), torch.randn(2, REL_BUCKETS, generator=gen, dtype=torch.float64)
    dense = torch.randn(1, 1, 5, 7, generator=gen, dtype=torch.float64)
    dense[..., 2] = float("-inf")
    by_hand = {
        "alibi": -slopes.numpy()[:, None, None] * np.abs(p - j),
        "relative": table.numpy()[:, (j > p) * (REL_BUCKETS // 2) + np.abs(j - p)],
        "dense": dense.numpy(),
    }
    for kind, param in (("alibi", slopes), ("relative", table), ("dense", dense)):
        ex = TermsExample(torch.float64, q, k, v, M.causal(), -0.6, 2.5, kind, param, "math")
        out, lse = _terms_formula(ex, q, k, v, param, torch.float64)
        trace = R.attention(q.numpy(), k.numpy(), v.numpy(), M.causal().to_dense(5, 7).numpy(), -0.6,
                            bias=by_hand[kind], softcap=2.5)
        np.testing.assert_allclose(out.numpy(), trace.output, atol=1e-12)
        np.testing.assert_allclose(lse.numpy(), trace.lse, atol=1e-12)
