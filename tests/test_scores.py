"""Score terms (bias, softcap, score_mod) on every path against the float64 reference.

The reference receives the bias as an array computed independently of qkv.bias: ALiBi from
the paper's slopes and |p_i - j| by hand, T5's buckets from transformers. Gradients of q, k, v
come from `reference.attention_grads`; those of the ALiBi slopes and the relative table from
`reference.logit_grads` summed by hand over the pairs each parameter touches.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from qkv import bias as Bi
from qkv import masks as M
from qkv import reference as R
from tests._attention_cases import Case

BACKENDS = ("auto", "math", "blocks")


def _masks(case: Case) -> dict[str, object]:
    L, S, B = case.L, case.S, case.B
    gen = torch.Generator().manual_seed(3)
    ids = torch.sort(torch.randint(0, 3, (S,), generator=gen)).values
    valid = torch.rand(B, S, generator=gen) > 0.3
    q_lengths = [L // 3, L - L // 3]
    k_lengths = [S - S // 2, S // 2]
    return {
        "none": None,
        "causal": M.causal(),
        "window": M.sliding_window(5, 2),
        "prefix": M.prefix_lm(3) & M.causal(),
        "documents": M.documents(ids[-L:], ids) if L <= S else M.documents(torch.sort(torch.randint(0, 3, (L,), generator=gen)).values, ids),
        "key_padding": M.key_padding(valid),
        "predicate": M.predicate(lambda b, h, i, j: (i + j) % 3 != 0),
        "varlen": M.varlen(q_lengths, k_lengths, causal=True),
        "padded": M.padded([max(1, L - 2)] * B, [S] * B, window=(4, 1)),
        "bool": torch.rand(B, 1, L, S, generator=gen) > 0.4,
    }


def _bool_dense(mask: object, L: int, S: int) -> np.ndarray | None:
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor):
        return mask.numpy()
    return mask.to_dense(L, S).numpy()  # type: ignore[attr-defined]


def _positions(mask: object, B: int, L: int, S: int) -> np.ndarray:
    """(B | 1, L) query positions by hand: bottom-right, or each document's own."""
    if isinstance(mask, M.Varlen):
        out = []
        for ql, kl, k0 in zip(mask.q_lengths.tolist(), mask.k_lengths.tolist(), np.cumsum([0, *mask.k_lengths.tolist()]), strict=False):
            out += [k0 + i + kl - ql for i in range(ql)]
        return np.array([out])
    if isinstance(mask, M.Padded):
        return np.array([[i + kl - ql for i in range(L)] for ql, kl in zip(mask.q_lengths.tolist(), mask.k_lengths.tolist(), strict=True)])
    return np.arange(L)[None] + S - L


def _bias_case(kind: str, case: Case, mask: object) -> tuple[object, dict[str, torch.Tensor], np.ndarray, object]:
    """(bias for qkv, its learnable tensors, the bias array for the reference (B|1, H, L, S),
    a function d_logits -> expected gradients of the learnable tensors)."""
    H, L, S, B = case.H, case.L, case.S, case.B
    gen = torch.Generator().manual_seed(5)
    pos = _positions(mask, B, L, S)[:, None, :, None]  # (B | 1, 1, L, 1)
    keys = np.arange(S)[None, None, None, :]
    if kind == "alibi":
        slopes = torch.rand(H, generator=gen, dtype=torch.float64)
        distance = np.abs(pos - keys)  # (B | 1, 1, L, S)
        array = -slopes.numpy()[None, :, None, None] * distance
        return Bi.alibi(slopes), {"slopes": slopes}, array, lambda dx: {"slopes": -(dx * distance).sum(axis=(0, 2, 3))}
    if kind == "alibi-default":
        slopes = np.array([2.0 ** (-8 * (i + 1) / H) for i in range(H)]) if H & (H - 1) == 0 else None
        assert slopes is not None  # the grid uses power-of-two H here (the slopes are tested apart)
        return Bi.alibi(), {}, -slopes[None, :, None, None] * np.abs(pos - keys), lambda dx: {}
    if kind == "relative":
        t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
        table = torch.randn(H, 32, generator=gen, dtype=torch.float64)
        rel = torch.from_numpy(np.broadcast_to(keys - pos, (pos.shape[0], 1, L, S)).copy())
        bucket = t5.T5Attention._relative_position_bucket(rel, bidirectional=True).numpy()  # (B | 1, 1, L, S)
        array = table.numpy()[np.arange(H)[None, :, None, None], bucket]

        def table_grad(dx: np.ndarray) -> dict[str, np.ndarray]:
            grad = np.zeros((H, 32))
            full = np.broadcast_to(bucket, dx.shape)
            for h in range(H):
                np.add.at(grad[h], full[:, h].ravel(), dx[:, h].ravel())
            return {"table": grad}

        return Bi.relative(table), {"table": table}, array, table_grad
    if kind == "dense":
        t = torch.randn(1, H, L, S, generator=gen, dtype=torch.float64)
        return t, {"dense": t}, t.numpy(), lambda dx: {"dense": dx.sum(axis=0, keepdims=True)}
    raise AssertionError(kind)


def _run(backend: str, case: Case, mask: object, bias: object, tensors: dict, softcap: float | None, d_out: torch.Tensor):
    q, k, v = case.tensors()
    for t in (q, k, v, *tensors.values()):
        t.requires_grad_(True)
        t.grad = None
    out, lse = qkv.attention(q, k, v, mask, bias=bias, softcap=softcap, return_lse=True, backend=backend)
    (out * d_out).sum().backward()
    grads = {name: t.grad for name, t in tensors.items()}
    return out.detach(), lse.detach(), (q.grad, k.grad, v.grad), grads


CASES = [Case(2, 4, 2, 13, 17, 8, 5), Case(1, 2, 1, 20, 11, 59, 3), Case(2, 2, 2, 1, 9, 4, 4)]
MASK_NAMES = ("none", "causal", "window", "prefix", "documents", "key_padding", "predicate", "varlen", "padded", "bool")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"L{c.L}S{c.S}E{c.E}G{c.G}")
@pytest.mark.parametrize("mask_name", MASK_NAMES)
@pytest.mark.parametrize(
    ("bias_kind", "softcap"), [("alibi", None), ("relative", None), ("dense", None), (None, 1.5), ("relative", 1.5)]
)
def test_every_mask_with_every_bias_and_softcap_matches_reference(case: Case, mask_name: str, bias_kind: str | None, softcap: float | None) -> None:
    mask = _masks(case)[mask_name]
    L, S = case.L, case.S
    q, k, v = case.tensors()
    gen = torch.Generator().manual_seed(9)
    d_out = torch.randn(case.B, case.H, L, case.Ev, generator=gen, dtype=torch.float64)
    if bias_kind is None:
        bias, tensors, array, expected_grads = None, {}, None, lambda dx: {}
    else:
        bias, tensors, array, expected_grads = _bias_case(bias_kind, case, mask)
    trace = R.attention(q.numpy(), k.numpy(), v.numpy(), _bool_dense(mask, L, S), bias=array, softcap=softcap)
    dq, dk, dv = R.attention_grads(trace, d_out.numpy())
    d_logits = R.logit_grads(trace, d_out.numpy())
    # "auto" takes the math path or SDPA at these sizes: both are run by name
    backends = ["math"] if isinstance(mask, torch.Tensor) else ["math", "blocks"]
    if softcap is None:
        backends.append("fused")
    for backend in backends:
        out, lse, (gq, gk, gv), grads = _run(backend, case, mask, bias, tensors, softcap, d_out)
        np.testing.assert_allclose(out.numpy(), trace.output, atol=1e-10, err_msg=backend)
        np.testing.assert_array_equal(np.isneginf(lse.numpy()), np.isneginf(trace.lse))
        finite = np.isfinite(trace.lse)
        np.testing.assert_allclose(lse.numpy()[finite], trace.lse[finite], atol=1e-10, err_msg=backend)
        for got, want in ((gq, dq), (gk, dk), (gv, dv)):
            np.testing.assert_allclose(got.numpy(), want, atol=1e-9, err_msg=backend)
        for name, want in expected_grads(d_logits).items():
            np.testing.assert_allclose(grads[name].numpy(), want, atol=1e-9, err_msg=f"{backend} d{name}")


def _mod(s, b, h, i, j):
    """A score_mod on torch tensors (index arithmetic in the scores' dtype) ..."""
    b, h, i, j = (x.to(s.dtype) for x in (b, h, i, j))
    return s - (0.05 * (h + 1) * abs(i - j) - 0.3 * ((i + 2 * j + b) % 3 == 0).to(s.dtype))


def _mod_numpy(s, b, h, i, j):
    """... and the same written for the NumPy reference."""
    return s - (0.05 * (h + 1) * np.abs(i - j) - 0.3 * ((i + 2 * j + b) % 3 == 0))


@pytest.mark.parametrize("mask_name", ["none", "causal", "varlen", "documents", "bool"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_score_mod_matches_reference(mask_name: str, backend: str) -> None:
    case = Case(2, 4, 2, 21, 30, 8, 6)
    mask = _masks(case)[mask_name]
    if backend == "blocks" and isinstance(mask, torch.Tensor):
        return
    q, k, v = case.tensors()
    trace = R.attention(q.numpy(), k.numpy(), v.numpy(), _bool_dense(mask, case.L, case.S), score_mod=_mod_numpy, softcap=4.0)
    out = qkv.attention(q, k, v, mask, score_mod=_mod, softcap=4.0, backend=backend)
    np.testing.assert_allclose(out.numpy(), trace.output, atol=1e-10)


def test_score_mod_gradients_by_finite_differences_on_the_engine() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 6, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 8, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 8, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    slopes = torch.rand(2, generator=gen, dtype=torch.float64, requires_grad=True)

    def run(q, k, v, slopes):
        out, lse = qkv.attention(
            q, k, v, M.sliding_window(3, 1), bias=Bi.alibi(slopes), softcap=2.0, score_mod=_mod,
            return_lse=True, backend="blocks",
        )
        return out, lse.masked_fill(lse.isinf(), 0.0)  # the lse's gradient counts too

    assert torch.autograd.gradcheck(run, (q, k, v, slopes))


def test_engine_gradients_are_deterministic_and_empty_rows_are_zero() -> None:
    case = Case(2, 4, 2, 400, 300, 16, 16)
    q, k, v = case.tensors(torch.float32)
    table = torch.randn(4, 32, requires_grad=True)
    mask = M.varlen([100, 0, 300], [50, 200, 50], causal=True)  # the last document: 250 rows see nothing
    results = []
    for _ in range(2):
        for t in (q, k, v, table):
            t.requires_grad_(True)
            t.grad = None
        out = qkv.attention(q, k, v, mask, bias=Bi.relative(table), softcap=30.0, backend="blocks")
        out.square().sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad, table.grad])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    out, dq = results[0][0], results[0][1]
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    assert (out[:, :, 100:350] == 0).all() and (dq[:, :, 100:350] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_by_the_tolerance_rule(dtype: torch.dtype) -> None:
    case = Case(1, 4, 2, 300, 300, 32, 32)
    q64, k64, v64 = case.tensors()
    mask = M.sliding_window(64) & M.causal()
    gen = torch.Generator().manual_seed(2)
    table = torch.randn(4, 32, generator=gen, dtype=torch.float64)
    d_out = torch.randn(1, 4, 300, 32, generator=gen, dtype=torch.float64)

    def grads(q, k, v, table, backend, **kw):
        q, k, v, table = (t.detach().clone().requires_grad_(True) for t in (q, k, v, table))
        out = qkv.attention(q, k, v, mask, bias=Bi.alibi() + Bi.relative(table), softcap=5.0, backend=backend, **kw)
        (out.double() * d_out).sum().backward()
        return [out.double(), q.grad.double(), k.grad.double(), v.grad.double(), table.grad.double()]

    exact = grads(q64, k64, v64, table, "math")
    low = [t.to(dtype) for t in (q64, k64, v64)]
    fast = grads(*low, table.float(), "blocks")

    # the naive implementation: every step in the low dtype, the bias too
    def naive(q, k, v, table):
        q, k, v, table = (t.detach().clone().requires_grad_(True) for t in (q, k, v, table))
        s = torch.tanh((q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * (32**-0.5) / 5.0) * 5.0
        s = s + (Bi.alibi().to_dense(300, 300, H=4) + Bi.relative(table).to_dense(300, 300)).to(dtype)
        s = s.masked_fill(~mask.to_dense(300, 300), float("-inf"))
        out = torch.softmax(s, dim=-1) @ v.repeat_interleave(2, 1)
        (out.double() * d_out).sum().backward()
        return [out.double(), q.grad.double(), k.grad.double(), v.grad.double(), table.grad.double()]

    slow = naive(*low, table.to(dtype))
    for i, (e, f, n) in enumerate(zip(exact, fast, slow, strict=True)):
        factor = 2 if i == 0 else 3
        err_fast = (f - e).abs().max().item()
        err_naive = (n - e).abs().max().item()
        assert err_fast <= factor * err_naive + 1e-4, (i, err_fast, err_naive)


def test_explain_names_the_terms_and_counts_their_work() -> None:
    q = k = v = torch.randn(1, 8, 1024, 16)
    e = qkv.explain(q, k, v, M.sliding_window(128) & M.causal(), bias=Bi.alibi(), softcap=50.0)
    assert e.path == "blocks"
    assert e.scores == "softcap 50 + alibi(8 heads)"
    pairs = e.visited_fraction * 1024 * 1024 * 8
    assert e.score_flops == int((3 + 4) * pairs)
    assert "scores: softcap 50 + alibi(8 heads)" in str(e)
    small = qkv.explain(q[:, :, :8], k[:, :, :8], v[:, :, :8], bias=Bi.alibi())
    assert small.path == "fused" and "alibi(8 heads) is passed as a dense float mask" in small.reason
    assert qkv.explain(q[:, :, :8], k[:, :, :8], v[:, :, :8], softcap=3.0).path == "math"


def test_paths_that_cannot_take_the_terms_say_so() -> None:
    q = k = v = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"backend='fused'.*softcap or score_mod"):
        qkv.attention(q, k, v, softcap=2.0, backend="fused")
    weight = torch.tensor(0.5, requires_grad=True)
    q.requires_grad_(True)

    def learned(s, b, h, i, j):
        return s * weight

    with pytest.raises(ValueError, match="score_mod reads tensors that require grad"):
        qkv.attention(q, k, v, M.causal(), score_mod=learned, backend="blocks")
    big = torch.randn(1, 2, 300, 4, requires_grad=True)
    assert qkv.explain(big, big, big, M.causal(), score_mod=learned).path == "math"
    out = qkv.attention(big, big, big, M.causal(), score_mod=learned)
    out.sum().backward()
    assert weight.grad is not None and weight.grad != 0


def test_attention_weights_with_terms_match_the_full_weights() -> None:
    case = Case(2, 4, 2, 300, 280, 8, 8)
    q, k, v = case.tensors()
    kw = {"bias": Bi.alibi(), "softcap": 3.0, "score_mod": _mod}
    for mask in (M.sliding_window(20) & M.causal(), torch.rand(2, 1, 300, 280) > 0.5):
        _, full = qkv.attention(q, k, v, mask, return_weights=True, backend="math", **kw)
        picked = qkv.attention_weights(q, k, v, mask, heads=[3, 1], rows=[0, 150, 299], **kw)
        torch.testing.assert_close(picked, full[:, [3, 1]][:, :, [0, 150, 299]], atol=1e-12, rtol=0)
        _, blocks_weights = qkv.attention(q, k, v, mask, return_weights=True, **kw)
        torch.testing.assert_close(blocks_weights, full, atol=1e-12, rtol=0)


def test_keys_and_values_with_batch_one_broadcast() -> None:
    q = torch.randn(3, 4, 7, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 9, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 9, 5, dtype=torch.float64, requires_grad=True)
    for backend in ("fused", "math", "blocks"):
        out = qkv.attention(q, k, v, M.causal(), backend=backend)
        expected = qkv.attention(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1), M.causal(), backend="math")
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
        k.grad = None
        out.sum().backward()
        assert k.grad is not None and k.grad.shape == (1, 2, 9, 8)
    with pytest.raises(ValueError, match="batch dimensions"):
        qkv.attention(q, torch.randn(2, 2, 9, 8, dtype=torch.float64), torch.randn(2, 2, 9, 5, dtype=torch.float64))


def test_a_long_awkward_problem_on_the_engine_matches_the_reference() -> None:
    # 1025 rows: the tile grid's last row group and key block are partial
    case = Case(1, 2, 1, 1025, 1025, 16, 12)
    q, k, v = case.tensors()
    mask = M.sliding_window(300, 40) & M.causal()
    slopes = torch.tensor([0.3, 0.05], dtype=torch.float64)
    p = np.arange(1025)
    alibi = -slopes.numpy()[:, None, None] * np.abs(p[:, None] - p[None, :])[None]
    d_out = torch.randn(1, 2, 1025, 12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    trace = R.attention(q.numpy(), k.numpy(), v.numpy(), mask.to_dense(1025, 1025).numpy(), bias=alibi, softcap=2.5)
    dq, dk, dv = R.attention_grads(trace, d_out.numpy())
    d_slopes = -(R.logit_grads(trace, d_out.numpy()) * np.abs(p[:, None] - p[None, :])).sum(axis=(0, 2, 3))
    slopes.requires_grad_(True)
    for t in (q, k, v):
        t.requires_grad_(True)
    assert qkv.explain(q, k, v, mask, bias=Bi.alibi(slopes), softcap=2.5).path == "blocks"
    out = qkv.attention(q, k, v, mask, bias=Bi.alibi(slopes), softcap=2.5)
    (out * d_out).sum().backward()
    np.testing.assert_allclose(out.detach().numpy(), trace.output, atol=1e-10)
    for got, want in ((q.grad, dq), (k.grad, dk), (v.grad, dv), (slopes.grad, d_slopes)):
        np.testing.assert_allclose(got.numpy(), want, atol=1e-8)


@pytest.mark.parametrize("cap", [np.float32(2.0), np.float64(2.0), torch.tensor(2.0), torch.tensor([2.0]), 2])
def test_softcap_takes_a_number_in_every_form_scale_takes(cap: object) -> None:
    """softcap * tanh(s / softcap), checked against the formula in float64 by hand."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    scores = 2.0 * torch.tanh((q @ k.transpose(-1, -2) / 2.0) / 2.0)  # scale 1/sqrt(4), cap 2
    expected = torch.softmax(scores, dim=-1) @ v
    torch.testing.assert_close(qkv.attention(q, k, v, softcap=cap), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cap", [torch.tensor(2.0, requires_grad=True), torch.tensor([2.0, 3.0]), np.bool_(True), 0.0, -1.0])
def test_softcap_still_refuses_what_is_no_positive_number(cap: object) -> None:
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="softcap must be a positive finite number"):
        qkv.attention(q, q, q, softcap=cap)


def _raises(score, b, h, q_idx, kv_idx):
    raise KeyError("my own mistake")


@pytest.mark.parametrize(
    ("score_mod", "error", "message"),
    [
        (_raises, KeyError, "my own mistake"),
        (lambda score, b, h, q_idx, kv_idx: 1.0, TypeError, "must return a float tensor, got float"),
        (lambda score, b, h, q_idx, kv_idx: (q_idx > kv_idx), TypeError, "must return a float tensor, got torch.bool"),
    ],
)
def test_a_broken_score_mod_on_flex_fails_with_its_own_error(score_mod, error: type, message: str) -> None:
    """Inside torch.compile the same mistakes come out as torch._dynamo's "Unsupported"."""
    q = torch.randn(1, 2, 16, 16)
    for backend in ("flex", "math"):
        with pytest.raises(error, match=message):
            qkv.attention(q, q, q, M.causal(), score_mod=score_mod, backend=backend)


@pytest.mark.parametrize("softcap", [None, 30.0])  # the flash kernel's tiles; qkv's own
@pytest.mark.parametrize("kind", ["relative", "alibi", "dense", "captured"])
def test_every_gradient_is_bitwise_equal_across_two_runs_at_two_threads(kind: str, softcap: float | None) -> None:
    """Gradients of q, k, v and of every score-term tensor repeat bit for bit at a fixed thread
    count. The T5 table's gradient on the block engine with a window used to differ between
    identical calls (6 values in 8 at 2 threads): advanced indexing's backward adds repeated
    indices in a thread-timed order."""
    case = Case(B=1, H=4, G=2, L=1024, S=1024, E=32, Ev=32)
    q0, k0, v0 = case.tensors(torch.float32, seed=11)
    gen = torch.Generator().manual_seed(12)
    table0, slopes0 = torch.randn(4, 32, generator=gen), torch.rand(4, generator=gen)
    dense0 = torch.randn(1, 1, 1024, 1024, generator=gen)
    threads = torch.get_num_threads()
    runs = []
    try:
        torch.set_num_threads(2)
        for _ in range(4):
            q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
            param = {"relative": table0, "alibi": slopes0, "dense": dense0, "captured": slopes0}[kind].clone().requires_grad_(True)
            score_mod = None
            if kind == "relative":
                bias: object = Bi.relative(param)
            elif kind == "alibi":
                bias = Bi.alibi(param)
            elif kind == "dense":
                bias = param
            else:
                bias = None

                def score_mod(s, b, h, i, j, slopes=param):  # type: ignore[no-untyped-def]  # captures the slopes
                    return s - slopes[h] * (i - j).abs()

            backend = "auto" if kind == "captured" else "blocks"
            out = qkv.attention(q, k, v, M.sliding_window(256), bias=bias, score_mod=score_mod, softcap=softcap, backend=backend)
            out.square().sum().backward()
            runs.append([t.grad for t in (q, k, v, param)])
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert a is not None and b is not None and torch.equal(a, b)
