"""bfloat16 layers on a CPU that only emulates bf16 products (the AVX2 tier, forced here with
QKV_CPU_TIER whatever this machine is): `MultiHeadAttention` and the encoder compute in float32
with float32 copies of their bf16 weights (`qkv.native.onednn_linear.wide_copy`), kept between
calls and rebuilt when a weight changes.

Expected values come from float64 computations on the bf16 weights' values, never from the
code under test."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import qkv
from qkv.attention import problem as attention_problem
from qkv.attention.bounds import KVBounds
from qkv.models.bert import BertEncoder
from qkv.models.config import BertConfig
from qkv.native import magnitude, onednn_linear
from qkv.native.machine import KEEP_VARIABLE, TIER_VARIABLE, compute_dtype
from tests.kernels._spy import CallSpy

BF16_EPS = 2.0**-8  # bfloat16's relative rounding error (8 significant bits)


@pytest.fixture(autouse=True)
def _emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIER_VARIABLE, "avx2")  # bf16 products emulated, as on an AVX2 machine
    monkeypatch.delenv(KEEP_VARIABLE, raising=False)
    assert compute_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32


def _mha_reference(module: qkv.MultiHeadAttention, x: torch.Tensor, mask: object = None) -> torch.Tensor:
    """The layer in float64 on x's values: its weights' values exactly, float64 products."""
    wide = copy.deepcopy(module).double()
    with torch.no_grad():
        return wide(x.double(), mask=mask)


def _within_bf16_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    # the output is rounded to bf16 once (half an ulp), after float32 products (far below it)
    bound = BF16_EPS * want.abs() + 1e-6
    assert got.dtype == torch.bfloat16
    assert bool(((got.double() - want).abs() <= bound).all()), (got.double() - want).abs().max().item()


def test_wide_copy_is_the_exact_conversion_and_is_kept() -> None:
    weight = torch.nn.Parameter(torch.randn(6, 4).bfloat16(), requires_grad=False)
    first = onednn_linear.wide_copy(torch.float32, weight)
    assert first.dtype == torch.float32 and torch.equal(first.double(), weight.double())
    assert onednn_linear.wide_copy(torch.float32, weight) is first  # no conversion on the next call


def test_wide_copy_follows_in_place_updates_and_replaced_data() -> None:
    weight = torch.nn.Parameter(torch.randn(6, 4).bfloat16())
    with torch.no_grad():
        before = onednn_linear.wide_copy(torch.float32, weight)
        weight.mul_(2)  # what an optimizer step does: bumps the version counter
        doubled = onednn_linear.wide_copy(torch.float32, weight)
        assert doubled is not before and torch.equal(doubled.double(), weight.double())
        weight.data = torch.ones(6, 4, dtype=torch.bfloat16)  # new storage
        assert torch.equal(onednn_linear.wide_copy(torch.float32, weight), torch.ones(6, 4))


def test_forget_wide_copies_sees_writes_through_data() -> None:
    weight = torch.nn.Parameter(torch.randn(6, 4).bfloat16())
    with torch.no_grad():
        onednn_linear.wide_copy(torch.float32, weight)
        weight.data.mul_(3)  # bypasses the version counter: documented as not seen
        onednn_linear.forget_wide_copies()
        assert torch.equal(onednn_linear.wide_copy(torch.float32, weight).double(), weight.double())


def test_wide_copy_keeps_the_gradient_path() -> None:
    weight = torch.nn.Parameter(torch.randn(3, 2).bfloat16())
    wide = onednn_linear.wide_copy(torch.float32, weight)
    assert wide.requires_grad
    wide.sum().backward()
    assert weight.grad is not None and torch.equal(weight.grad, torch.ones(3, 2, dtype=torch.bfloat16))


def test_copies_made_in_inference_mode_serve_a_later_backward() -> None:
    # frozen bf16 weights: the copies are kept even with grad enabled, and the input's
    # gradient saves them for backward
    torch.manual_seed(4)
    module = qkv.MultiHeadAttention(16, 2).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(1, 20, 16).bfloat16()
    with torch.inference_mode():
        module(x)
    x.requires_grad_(True)
    module(x).float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16 and bool(x.grad.isfinite().all())


def test_wide_copy_of_several_sources_is_their_concatenation() -> None:
    parts = [torch.randn(2, 3).bfloat16() for _ in range(3)]
    got = onednn_linear.wide_copy(torch.float32, *parts)
    assert torch.equal(got, torch.cat(parts).float())
    parts[1].add_(1)
    assert torch.equal(onednn_linear.wide_copy(torch.float32, *parts), torch.cat(parts).float())


@pytest.mark.parametrize("rows", [3, 64])  # separate projections, and the fused one (B * L >= D)
def test_multihead_bf16_equals_float64_within_bf16_rounding(rows: int) -> None:
    torch.manual_seed(0)
    module = qkv.MultiHeadAttention(32, 4).to(torch.bfloat16).eval()
    x = torch.randn(1, rows, 32).bfloat16()
    with torch.no_grad():
        got = module(x, mask=qkv.masks.causal())
    _within_bf16_rounding(got, _mha_reference(module, x, qkv.masks.causal()))


def test_multihead_bf16_sees_an_optimizer_step() -> None:
    torch.manual_seed(1)
    module = qkv.MultiHeadAttention(32, 4).to(torch.bfloat16)
    x = torch.randn(2, 40, 32).bfloat16()
    module.eval()
    with torch.no_grad():
        before = module(x)  # builds the float32 copies
    module.train()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    module(x).float().pow(2).sum().backward()
    optimizer.step()
    module.eval()
    with torch.no_grad():
        after = module(x)
    assert not torch.equal(before, after)
    _within_bf16_rounding(after, _mha_reference(module, x))


def test_multihead_bf16_training_step_has_gradients_for_the_bf16_weights() -> None:
    torch.manual_seed(2)
    module = qkv.MultiHeadAttention(16, 2).to(torch.bfloat16)
    x = torch.randn(2, 20, 16).bfloat16()
    out = module(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16, name


def test_forward_float32_refuses_a_layer_that_computes_in_its_own_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    module = qkv.MultiHeadAttention(16, 2).to(torch.bfloat16)
    monkeypatch.setenv(KEEP_VARIABLE, "1")  # bf16 kept: the layer computes in bf16
    with pytest.raises(TypeError, match="computes in"):
        module.forward_float32(torch.randn(1, 3, 16))


def _tiny_encoder() -> tuple[BertEncoder, BertEncoder]:
    """A small random encoder in mixed bf16 precision, and its float64 twin with the same
    (bf16-rounded) weights."""
    torch.manual_seed(3)
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    model = BertEncoder(config).set_matmul_dtype(torch.bfloat16).eval()
    return model, copy.deepcopy(model).double()


def test_encoder_bf16_equals_float64_on_its_weights() -> None:
    model, reference = _tiny_encoder()
    ids = torch.randint(0, 50, (3, 40))
    valid = torch.arange(40) < torch.tensor([[40], [25], [7]])  # (3, 40)
    with torch.no_grad():
        got = model(ids, valid=valid).last_hidden
        want = reference(ids, valid=valid).last_hidden
    assert got.dtype == torch.float32
    # float32 products on the bf16 weights' values: float32 rounding, far below bf16's
    error = (got.double() - want).abs().max().item()
    assert error <= 1e-4 * max(1.0, want.abs().max().item()), error


def test_encoder_bf16_sees_changed_weights() -> None:
    model, _ = _tiny_encoder()
    ids = torch.randint(0, 50, (2, 30))
    with torch.no_grad():
        model(ids)  # builds the float32 copies
        for layer in model.blocks:
            layer.ffn_in.weight.mul_(0.5)  # in place, as an optimizer step
            layer.attention.q_proj.weight.add_(0.25)
        got = model(ids).last_hidden
        want = copy.deepcopy(model).double()(ids).last_hidden
    error = (got.double() - want).abs().max().item()
    assert error <= 1e-4 * max(1.0, want.abs().max().item()), error


def test_encoder_bf16_with_a_hooked_attention_runs_the_hook() -> None:
    model, reference = _tiny_encoder()
    seen = []
    model.blocks[0].attention.register_forward_hook(lambda _m, args, _out: seen.append(args[0].dtype))
    ids = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        got = model(ids).last_hidden
        want = reference(ids).last_hidden
    assert seen == [torch.bfloat16]  # the module's own call, in its dtype
    assert math.isclose(torch.nn.functional.cosine_similarity(got.flatten().double(), want.flatten(), dim=0).item(), 1.0, abs_tol=1e-4)


@pytest.mark.parametrize("mask", [None, qkv.masks.causal(), qkv.masks.sliding_window(8, 8)])
def test_attention_in_the_kept_buffer_equals_float64_call_after_call(mask: object) -> None:
    # inference calls widen into one buffer per thread: each result must be its own inputs'
    gen = torch.Generator().manual_seed(5)
    calls = [[torch.randn(2, 3, 40, 16, generator=gen).bfloat16() for _ in range(3)] for _ in range(3)]
    calls[1] = [x[:, :, :24].contiguous() for x in calls[1]]  # a smaller call between two larger ones
    with torch.no_grad():
        results = [qkv.attention(*c, mask) for c in calls]
    for c, got in zip(calls, results, strict=True):
        want = qkv.attention(*(x.double() for x in c), mask, backend="math")
        _within_bf16_rounding(got, want)


def test_attention_with_gradients_does_not_use_the_kept_buffer() -> None:
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 30, 8, generator=gen).bfloat16().requires_grad_() for _ in range(3))
    out = qkv.attention(q, k, v, qkv.masks.causal())
    with torch.no_grad():  # an inference call in between reuses the buffer
        qkv.attention(*(torch.randn(1, 2, 30, 8, generator=gen).bfloat16() for _ in range(3)))
    out.float().sum().backward()
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    qkv.attention(*exact, qkv.masks.causal(), backend="math").sum().backward()
    for got, want in zip((q, k, v), exact, strict=True):
        assert got.grad is not None and want.grad is not None
        assert torch.allclose(got.grad.double(), want.grad, atol=0.05, rtol=0.05)


def test_emulated_call_scans_q_k_v_in_bf16_and_not_their_float32_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    # the widened call bounds q, k and v from the bf16 tensors: half the bytes of their float32 copies
    scanned: list[torch.dtype] = []
    original = attention_problem._largest_magnitudes

    def spy(tensors: tuple[torch.Tensor, ...]) -> list[float]:
        scanned.extend(t.dtype for t in tensors)
        return original(tensors)

    monkeypatch.setattr(attention_problem, "_largest_magnitudes", spy)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 30, 8, generator=gen).bfloat16() for _ in range(3))
    with torch.no_grad():
        got = qkv.attention(q, k, v, qkv.masks.causal())
    assert scanned == [torch.bfloat16] * 3  # q, k, v; their float32 copies are not scanned again
    _within_bf16_rounding(got, qkv.attention(q.double(), k.double(), v.double(), qkv.masks.causal(), backend="math"))


def test_large_emulated_call_scans_and_widens_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large bf16 inputs (a million values each) are read once for their check and their float32
    copies (`qkv.native.magnitude.widen_bf16`) where the compiled scan runs: the input check
    scans nothing more, the output is the one the separate scan and copy give, close to float64,
    and the overflow refusal and the NaN rule see the same magnitudes."""
    widened = CallSpy(monkeypatch, magnitude, "widen_bf16")
    scanned: list[torch.dtype] = []
    original = attention_problem._largest_magnitudes
    monkeypatch.setattr(attention_problem, "_largest_magnitudes", lambda ts: scanned.extend(t.dtype for t in ts) or original(ts))
    fused = magnitude.kernel_reason(torch.bfloat16) is None
    gen = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(1, 2, 4096, 128, generator=gen).bfloat16() for _ in range(3))  # 1,048,576 values each
    with torch.no_grad():
        got = qkv.attention(q, k, v)
        assert widened.calls == (1 if fused else 0) and scanned == ([] if fused else [torch.bfloat16] * 3)
        with qkv.backends.disabled("magnitude"):
            apart = qkv.attention(q, k, v)  # torch.aminmax, then torch's copies
    assert torch.equal(got, apart)
    _within_bf16_rounding(got[:, :, :16], qkv.attention(q[:, :, :16].double(), k.double(), v.double(), backend="math"))
    huge = q.clone()
    huge[0, 1, 4000, 7] = -1.0e38  # times the longest key (norm ~ 11): past half of float32's largest
    with torch.no_grad(), pytest.raises(ValueError, match="overflow"):
        qkv.attention(huge, k, v)
    k[0, 1, 10, 3] = math.nan  # rows 10.. of head 1 read it under a causal mask
    with torch.no_grad():
        poisoned = qkv.attention(q, k, v, qkv.masks.causal())
    assert bool(poisoned[0, 1, 10:].isnan().all()) and not bool(poisoned[0, 1, :10].isnan().any())
    assert not bool(poisoned[0, 0].isnan().any())


@pytest.mark.parametrize("mask", ["window", "causal", "documents"])
def test_block_engine_rounds_the_emulated_output_once(mask: str) -> None:
    """The block engine writes an emulated call's output in bf16 as it places each call's
    rows: the same bits as float32 attention on the same values rounded once by torch, with
    rows that several calls merge (documents) and the NaN rule (a NaN key in one document)."""
    masks = {
        "window": qkv.masks.sliding_window(40, 0),
        "causal": qkv.masks.causal(),
        "documents": qkv.masks.documents(torch.tensor([0] * 300 + [1] * 200 + [2] * 12)),
    }
    gen = torch.Generator().manual_seed(22)
    q, k, v = (torch.randn(2, 3, 512, 32, generator=gen).bfloat16() for _ in range(3))
    k[1, 2, 310, 4] = math.nan  # document 1 of batch row 1, head 2
    with torch.no_grad():
        got = qkv.attention(q, k, v, masks[mask], backend="blocks")
        want = qkv.attention(q.float(), k.float(), v.float(), masks[mask], backend="blocks").to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert bool(got[1, 2, 310:].isnan().any()) and not bool(got[0].isnan().any())


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("where", ["k", "v"])
def test_emulated_call_keeps_the_nan_rule_for_bad_keys_and_values(bad: float, where: str) -> None:
    # key 10 holds a non-finite entry: under a causal mask rows 10.. read it and become NaN, rows 0..9 are exact
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=gen).bfloat16() for _ in range(3))
    (k if where == "k" else v)[0, 1, 10, 3] = bad
    with torch.no_grad():
        got = qkv.attention(q, k, v, qkv.masks.causal())
    assert bool(got[0, 1, 10:].isnan().all()) and not bool(got[0, 0].isnan().any()) and not bool(got[0, 1, :10].isnan().any())
    want = qkv.attention(q.double(), k.double(), v.double(), qkv.masks.causal(), backend="math")  # the same rule in float64
    _within_bf16_rounding(got[0, 1, :10], want[0, 1, :10])
    _within_bf16_rounding(got[0, 0], want[0, 0])


def test_emulated_call_refuses_scores_that_overflow_float32() -> None:
    # max|q| * max|k| * E far beyond float32 (bf16 holds such values; its float32 scores would be inf)
    q = torch.full((1, 1, 4, 8), 1e30).bfloat16()
    with pytest.raises(ValueError, match="overflow"):
        qkv.attention(q, q.clone(), q.clone())


def test_emulated_call_keeps_the_nan_rule_for_a_bad_query() -> None:
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=gen).bfloat16() for _ in range(3))
    q[0, 1, 10, 3] = math.inf
    with torch.no_grad():
        got = qkv.attention(q, k, v, qkv.masks.causal())
    nan_rows = got.isnan().all(dim=-1)  # (1, 2, 20)
    assert nan_rows[0, 1, 10] and int(nan_rows.sum()) == 1 and not bool(got.isnan().any(dim=-1)[~nan_rows].any())
    want = qkv.attention(q.double(), k.double(), v.double(), qkv.masks.causal(), backend="math")
    keep = ~nan_rows[0]
    _within_bf16_rounding(got[0][keep], want[0][keep])


def test_emulated_call_with_cache_bounds_scans_only_the_query(monkeypatch: pytest.MonkeyPatch) -> None:
    scanned: list[tuple[torch.dtype, tuple[int, ...]]] = []
    original = attention_problem._largest_magnitudes

    def spy(tensors: tuple[torch.Tensor, ...]) -> list[float]:
        scanned.extend((t.dtype, tuple(t.shape)) for t in tensors)
        return original(tensors)

    gen = torch.Generator().manual_seed(10)
    q = torch.randn(1, 2, 3, 8, generator=gen).bfloat16()
    k, v = (torch.randn(1, 2, 30, 8, generator=gen).bfloat16() for _ in range(2))
    bounds = KVBounds.of(k, v)
    monkeypatch.setattr(attention_problem, "_largest_magnitudes", spy)
    with torch.no_grad():
        got = qkv.attention(q, k, v, kv_bounds=bounds)
    assert scanned == [(torch.bfloat16, (1, 2, 3, 8))]
    _within_bf16_rounding(got, qkv.attention(q.double(), k.double(), v.double(), backend="math"))


def _projection_layout(x: torch.Tensor) -> torch.Tensor:
    """x (..., H, L, E) with the same values laid out as a projection's heads: (..., L, H, E)
    in memory, seen through a transpose."""
    return x.transpose(-3, -2).contiguous().transpose(-3, -2)


@pytest.mark.parametrize("layout", ["contiguous", "projection"])
@pytest.mark.parametrize("grad_mode", ["no_grad", "grad_enabled"])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "padding", "float"])
def test_emulated_call_widens_into_the_kept_buffer_in_the_inputs_layout(layout: str, grad_mode: str, mask: str) -> None:
    """Inputs that require no grad are widened into the kept buffer whether or not grad mode is
    on (fresh copies are page-faulted in on every call), heads seen through a transpose of a
    projection included, each copy with its input's strides; several batch dims and grouped
    heads; each result is its own inputs' after calls of other sizes."""
    from qkv.attention import functional

    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 3, 4, 24, 8, generator=gen).bfloat16()  # (B1, B2, H, L, E)
    k, v = (torch.randn(2, 3, 2, 24, 8, generator=gen).bfloat16() for _ in range(2))  # G = 2
    if layout == "projection":
        q, k, v = (_projection_layout(x) for x in (q, k, v))
    valid = torch.arange(24) < torch.tensor([[24, 3, 17], [9, 1, 24]])[..., None]  # (2, 3, 24): each row's first keys
    m: object = {"none": None, "causal": qkv.masks.causal(), "window": qkv.masks.sliding_window(3, 2),
                 "padding": valid[:, :, None, None, :],
                 "float": torch.randn(2, 3, 4, 24, 24, generator=gen)}[mask]  # fmt: skip
    copied: list[tuple[int, ...]] = []
    original = functional._attend

    def spy(q_wide: torch.Tensor, *args: object, **kwargs: object) -> object:
        copied.append(q_wide.stride())
        return original(q_wide, *args, **kwargs)

    functional._buffers.wide = None
    # without a mask these calls suit the short-sequence kernel, which widens in registers
    with pytest.MonkeyPatch.context() as patch, qkv.backends.disabled("short_wide"):
        patch.setattr(functional, "_attend", spy)
        with torch.set_grad_enabled(grad_mode == "grad_enabled"):
            smaller = qkv.attention(*(x[:, :, :, :5].bfloat16() for x in (q, k, v)))  # another size first
            got = qkv.attention(q, k, v, m)
    kept = functional._buffers.wide
    assert kept is not None and kept.dtype == torch.float32 and kept.numel() >= q.numel() + k.numel() + v.numel()
    assert copied[-1] == q.stride()  # the float32 copy has q's layout
    assert got.shape == (2, 3, 4, 24, 8)
    want = qkv.attention(q.double(), k.double(), v.double(), m, backend="math")  # type: ignore[arg-type]
    _within_bf16_rounding(got, want)
    _within_bf16_rounding(smaller, qkv.attention(*(x[:, :, :, :5].double() for x in (q, k, v)), backend="math"))


def test_a_float_mask_that_requires_grad_keeps_its_copies_out_of_the_kept_buffer() -> None:
    """A learnable float mask: the float32 copies of q, k and v are saved for its gradient, so
    an inference call in between (which reuses the kept buffer) must not change it."""
    gen = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=gen).bfloat16() for _ in range(3))
    mask = torch.randn(1, 2, 12, 12, generator=gen).requires_grad_()
    out = qkv.attention(q, k, v, mask)
    with torch.no_grad():
        qkv.attention(*(torch.randn(1, 2, 12, 8, generator=gen).bfloat16() for _ in range(3)))
    out.float().square().sum().backward()
    exact = mask.detach().double().requires_grad_()
    qkv.attention(q.double(), k.double(), v.double(), exact, backend="math").square().sum().backward()
    assert mask.grad is not None and exact.grad is not None
    assert torch.allclose(mask.grad.double(), exact.grad, atol=0.05, rtol=0.05)


# forward-mode AD loads torch's jvp decompositions, which call the deprecated torch.jit.script
# (torch/_decomp/decompositions_for_jvp.py): torch's internals, not the code under test
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_the_kept_buffer_after_inference_mode_vmap_and_forward_ad() -> None:
    """The kept buffer serves plain values only: a buffer made under torch.inference_mode is
    not written outside it, a vmapped or dual (forward-mode AD) call keeps its copies out of it,
    and each of these calls still gives its float64 answer (and tangent)."""
    from torch.autograd import forward_ad

    from qkv.attention import functional

    gen = torch.Generator().manual_seed(19)
    q, k, v = (torch.randn(2, 2, 40, 16, generator=gen).bfloat16() for _ in range(3))
    want = qkv.attention(q.double(), k.double(), v.double(), backend="math")
    with qkv.backends.disabled("short_wide"):  # the widening path, not the short-sequence kernel
        with torch.inference_mode():
            _within_bf16_rounding(qkv.attention(q, k, v), want)
        _within_bf16_rounding(qkv.attention(q, k, v), want)  # grad mode: the buffer is written again
        with torch.no_grad():
            _within_bf16_rounding(qkv.attention(q, k, v), want)
        _within_bf16_rounding(torch.vmap(qkv.attention)(q, k, v), want)
        tangent = torch.randn(q.shape, generator=gen).bfloat16()
        with forward_ad.dual_level():
            out = qkv.attention(forward_ad.make_dual(q, tangent), k, v, backend="math")
            assert forward_ad.unpack_dual(out).tangent is not None
            plain = qkv.attention(q, k, v, backend="math")  # the buffer carries no tangent over
            assert forward_ad.unpack_dual(plain).tangent is None
        _within_bf16_rounding(plain, want)
    assert functional._buffers.wide is None or not functional._buffers.wide.is_inference()



def test_torch_func_grad_through_a_widened_call() -> None:
    """torch.func.grad's wrappers have no storage: the bounds of the float32 copies are told
    apart without a data pointer (it raised), and the gradient is float64 autograd's."""
    gen = torch.Generator().manual_seed(23)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen).bfloat16() for _ in range(3))
    got = torch.func.grad(lambda x: qkv.attention(x, k, v, qkv.masks.causal()).float().square().sum())(q)
    exact = q.double().requires_grad_()
    qkv.attention(exact, k.double(), v.double(), qkv.masks.causal(), backend="math").square().sum().backward()
    assert got.dtype == torch.bfloat16 and exact.grad is not None
    assert torch.allclose(got.double(), exact.grad, atol=0.05, rtol=0.05)
