"""The short-sequence bf16 kernel (`qkv.native.short_bf16`), its dispatch and its fallback.

Every case goes through `qkv.attention` with ``backend="auto"`` and a spy that counts the
kernel's calls, so a test fails if the dispatcher silently stops choosing it on a machine that
can run it; on one that cannot (no AMX, no compiler) the same tests check SDPA and the reason.
Outputs are compared with the float64 reference by docs/design.md's tolerance rule (twice the
error of a naive bf16 implementation, plus a floor).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import qkv
from qkv.attention import dispatch
from qkv.native import build as compiled
from qkv.native import short_bf16, short_wide
from qkv.native.machine import cpu_features
from tests.kernels._compiler import REASON as FAILED_BUILD
from tests.kernels._compiler import use_failing_compiler
from tests.kernels._spy import CallSpy
from tests.kernels.test_blocks import _problem
from tests.kernels.test_blocks_bf16 import DTYPE, FLOOR, _err, _naive

CPU = torch.device("cpu")


def _can_run() -> bool:
    return short_bf16.unavailable_reason(DTYPE, CPU) is None


def _spy(monkeypatch: pytest.MonkeyPatch) -> CallSpy:
    """Counts the kernel's calls that returned a result."""
    return CallSpy(monkeypatch, short_bf16, "forward")


def _reference(q, k, v, valid: torch.Tensor | None, scale: float):  # type: ignore[no-untyped-def]
    """Float64 output (N, H, L, Ev) of the rounded inputs; valid (N, S) or None; rows that see
    no key give zeros."""
    mask = None if valid is None else valid[:, None, None, :].numpy()  # (N, 1, 1, S)
    return qkv.reference.attention(*(x.double().numpy() for x in (q, k, v)), mask, scale).output


def _valid(N: int, S: int, lengths: list[int]) -> torch.Tensor:
    return torch.arange(S).view(1, S) < torch.tensor(lengths).view(N, 1)  # (N, S)


# (N, H, G, L, S, E, Ev, key lengths per batch row or None for no mask)
CASES = {
    "sentence-batch": (4, 12, 12, 62, 62, 32, 32, [62, 40, 1, 17]),
    "gqa-odd-E-cross": (3, 4, 2, 7, 37, 33, 20, [37, 0, 5]),  # a batch row that sees nothing
    "one-query": (2, 3, 3, 1, 50, 64, 64, [50, 3]),
    "one-key": (2, 2, 1, 9, 1, 16, 48, [1, 1]),
    "no-mask-E128-Ev64": (2, 2, 2, 33, 100, 128, 64, None),
    "max-keys": (1, 2, 2, 40, 512, 32, 32, [300]),
    "E1": (2, 1, 1, 5, 31, 1, 17, None),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_by_the_tolerance_rule(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    N, H, G, L, S, E, Ev, lengths = CASES[case]
    q, k, v, _ = _problem(N, H, G, L, S, E, Ev, seed=7)
    q, k, v = (x.to(DTYPE) for x in (q, k, v))
    valid = None if lengths is None else _valid(N, S, lengths)
    mask = None if valid is None else valid[:, None, None, :]  # (N, 1, 1, S)
    scale = E**-0.5
    want = _reference(q, k, v, valid, scale)
    spy = _spy(monkeypatch)
    out = qkv.attention(q, k, v, mask, scale=scale)
    assert spy.calls == (1 if _can_run() else 0)
    assert out.dtype == DTYPE and out.shape == (N, H, L, Ev)
    dense = torch.ones(1, 1, L, S, dtype=torch.bool) if mask is None else mask
    naive = _naive(q, k, v, dense, scale)
    assert _err(out, want) <= 2 * _err(naive, want) + FLOOR
    if valid is not None:  # rows that see no key are exact zeros
        empty = ~valid.any(dim=1)
        assert bool((out[empty] == 0).all())


def test_strided_inputs_and_a_head_side_by_side_output(monkeypatch: pytest.MonkeyPatch) -> None:
    # q, k, v as views of one (N, L, 3, H, E) projection, as a multi-head layer makes them
    N, L, H, E = 3, 21, 4, 32
    gen = torch.Generator().manual_seed(2)
    qkv_rows = torch.randn(N, L, 3, H, E, generator=gen).to(DTYPE)
    q, k, v = qkv_rows.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (N, H, L, E), strided
    valid = _valid(N, L, [21, 8, 13])
    spy = _spy(monkeypatch)
    out = qkv.attention(q, k, v, valid[:, None, None, :])
    assert spy.calls == (1 if _can_run() else 0)
    want = _reference(q, k, v, valid, E**-0.5)
    assert _err(out, want) <= 2 * _err(_naive(q, k, v, valid[:, None, None, :], E**-0.5), want) + FLOOR
    if _can_run():  # the heads of a row sit side by side: concatenating them copies nothing
        assert out.transpose(1, 2).is_contiguous()


def test_inputs_whose_last_dim_is_not_contiguous(monkeypatch: pytest.MonkeyPatch) -> None:
    # transposed views (..., E, L) -> (..., L, E): the kernel reads rows, so they are copied
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(2, 3, 33, 7, generator=gen).to(DTYPE).transpose(-1, -2)  # (N, H, L, E), E strided
    k = torch.randn(2, 3, 33, 9, generator=gen).to(DTYPE).transpose(-1, -2)
    v = torch.randn(2, 3, 20, 9, generator=gen).to(DTYPE).transpose(-1, -2)
    spy = _spy(monkeypatch)
    out = qkv.attention(q, k, v)
    assert spy.calls == (1 if _can_run() else 0)
    want = _reference(q, k, v, None, 33**-0.5)
    dense = torch.ones(1, 1, 7, 9, dtype=torch.bool)
    assert _err(out, want) <= 2 * _err(_naive(q, k, v, dense, 33**-0.5), want) + FLOOR


def test_extreme_scores_stay_exact() -> None:
    # scaled scores of magnitude ~ 10^3: the row's max keeps exp() in range
    q, k, v, _ = _problem(2, 2, 2, 30, 45, 32, 32, seed=9)
    q, k, v = (x.to(DTYPE) for x in (q * 12, k * 12, v))
    valid = _valid(2, 45, [45, 20])
    out = qkv.attention(q, k, v, valid[:, None, None, :], scale=0.125)
    assert torch.isfinite(out).all()
    want = _reference(q, k, v, valid, 0.125)
    assert _err(out, want) <= 2 * _err(_naive(q, k, v, valid[:, None, None, :], 0.125), want) + FLOOR


@pytest.mark.parametrize("size", [3e4, 1e5])
def test_huge_scores_with_a_scale_that_rounds(size: float, monkeypatch: pytest.MonkeyPatch) -> None:
    # scaled scores ~ 1e9 to 1e10 with scale = 1 / sqrt(32), whose products round: the max key
    # must still get weight 1 (it once got the product's rounding error, ~ulp(1e9) = 64, as an
    # exponent: NaN or zero rows). Self-attention: each row's own key has the top score.
    spy = _spy(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(1, 2, 20, 32, generator=gen) * size).to(DTYPE)
    v = torch.randn(1, 2, 20, 32, generator=gen).to(DTYPE)
    out = qkv.attention(q, q, v)
    assert spy.calls == (1 if _can_run() else 0)
    want = _reference(q, q, v, None, 32**-0.5)
    assert torch.isfinite(out).all()
    assert _err(out, want) <= 2e-2  # the own key's value, rounded to bf16


def test_nan_rule_holds_on_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, _ = _problem(2, 2, 2, 6, 10, 32, 32, seed=3)
    q, k, v = (x.to(DTYPE) for x in (q, k, v))
    k[0, 1, 4, 0] = float("nan")  # key 4 of batch row 0, head 1: visible to row 0 only
    valid = _valid(2, 10, [10, 3])
    spy = _spy(monkeypatch)
    out = qkv.attention(q, k, v, valid[:, None, None, :])
    assert spy.calls == (1 if _can_run() else 0)  # the NaN rule cleans the inputs, then the kernel runs
    assert torch.isnan(out[0, 1]).all()
    assert torch.isfinite(out[0, 0]).all() and torch.isfinite(out[1]).all()


def test_dispatch_and_explain(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(2, 4, 10, 32).to(DTYPE)
    valid = _valid(2, 10, [10, 7])
    padding = valid[:, None, None, :]
    said = qkv.explain(q, q, q, padding)
    if _can_run():
        assert said.forward_kernel.startswith(f"the {short_bf16.KERNEL_NAME}")
        assert said.reason.startswith(f"the {short_bf16.KERNEL_NAME} applies")
    else:
        assert "does not run: " in said.forward_kernel

    def why(*args, **kwargs) -> str:  # type: ignore[no-untyped-def]
        return qkv.explain(*args, **kwargs).forward_kernel

    if _can_run():
        assert "backend='fused' asks for PyTorch's SDPA" in why(q, q, q, padding, backend="fused")
        for mask in (qkv.masks.key_padding(valid), qkv.masks.key_padding(torch.tensor([10, 7]))):  # qkv's own
            assert why(q, q, q, mask).startswith(f"the {short_bf16.KERNEL_NAME}")
            assert torch.equal(qkv.attention(q, q, q, mask), qkv.attention(q, q, q, padding))
        assert "not a bool key-padding mask" in why(q, q, q, qkv.masks.causal())
        assert "not a bool key-padding mask" in why(q, q, q, torch.ones(2, 1, 10, 10, dtype=torch.bool).tril())
        assert "not a bool key-padding mask" in why(q, q, q, torch.zeros(2, 1, 1, 10))  # a float mask
        long = torch.randn(1, 1, 8, short_bf16.MAX_KEYS + 1).to(DTYPE).transpose(-1, -2)  # (1, 1, S, 8)
        assert "more than its 512" in why(long[:, :, :3], long, long)
        trained = q.clone().requires_grad_(True)
        assert "gradients are needed" in why(trained, q, q, padding)
        assert "dropout" in why(q, q, q, padding, dropout=0.1)
        assert "weights nor lse" in why(q, q, q, padding, return_lse=True)
        assert "score terms" in why(q, q, q, padding, bias=torch.zeros(1, 1, 10, 10))
        one = q[:1, :1]  # one (batch row, head) task: one thread would do all the work
        threads = torch.get_num_threads()
        assert ("tasks for" in why(one, one, one)) == (threads > 1)
    assert qkv.explain(q.float(), q.float(), q.float(), padding).forward_kernel == ""  # float32: nothing to say
    monkeypatch.delenv("QKV_NO_COMPILED_KERNELS", raising=False)  # its own reason would come first
    monkeypatch.setenv("QKV_CPU_TIER", "avx2")  # as on an AVX2 machine, whatever this one is
    assert "this CPU's tier is avx2" in why(q, q, q, padding)


def test_a_gradient_takes_sdpa_and_its_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, d_out = _problem(2, 2, 2, 9, 9, 32, 32, seed=4)
    ql, kl, vl = (x.to(DTYPE).requires_grad_(True) for x in (q, k, v))
    spy = _spy(monkeypatch)
    out = qkv.attention(ql, kl, vl, _valid(2, 9, [9, 4])[:, None, None, :])
    out.backward(d_out.to(DTYPE))
    assert spy.calls == 0
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (ql, kl, vl))


def test_fallback_gives_the_same_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, _ = _problem(3, 4, 4, 40, 40, 32, 32, seed=2)
    q, k, v = (x.to(DTYPE) for x in (q, k, v))
    valid = _valid(3, 40, [40, 25, 9])
    want = _reference(q, k, v, valid, 32**-0.5)
    fast = qkv.attention(q, k, v, valid[:, None, None, :])
    spy = _spy(monkeypatch)
    with qkv.backends.disabled("short_bf16"):
        sdpa = qkv.attention(q, k, v, valid[:, None, None, :])
        explained = qkv.explain(q, k, v, valid[:, None, None, :])
    assert spy.calls == 0
    if cpu_features().amx:
        assert 'switched off (qkv.backends.disabled("short_bf16"))' in explained.forward_kernel
    else:  # short_wide is the candidate there (`short_kernel`): switching short_bf16 off leaves it
        assert explained.kernels[0] == ("short_wide" if short_wide.unavailable_reason(DTYPE, CPU) is None else "sdpa")
    for out in (fast, sdpa):  # both within the rounding of a bf16 output
        assert _err(out, want) < 1e-2


def test_no_compiled_kernels_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QKV_NO_COMPILED_KERNELS", "1")
    assert short_bf16.unavailable_reason(DTYPE, CPU) == "QKV_NO_COMPILED_KERNELS is set"
    q = torch.randn(1, 1, 8, 32).to(DTYPE)
    assert short_bf16.forward(q, q, q, None, 1.0) is None


def test_a_failed_build_is_a_reason_not_a_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    use_failing_compiler(monkeypatch, tmp_path)
    monkeypatch.setattr(short_bf16, "_built", {})
    monkeypatch.setattr(compiled, "static_reason", lambda *args, **kwargs: None)  # as on a machine that could run it
    monkeypatch.setattr(dispatch, "short_kernel", lambda q: "short_bf16")  # ... an AMX one (short_wide elsewhere)
    q, k, v, _ = _problem(2, 2, 2, 12, 12, 32, 32, seed=4)
    q, k, v = (x.to(DTYPE) for x in (q, k, v))
    valid = _valid(2, 12, [12, 5])
    out = qkv.attention(q, k, v, valid[:, None, None, :])  # SDPA runs
    assert _err(out, _reference(q, k, v, valid, 32**-0.5)) < 1e-2
    reason = short_bf16.unavailable_reason(DTYPE, CPU)
    assert reason == FAILED_BUILD
    assert reason in qkv.explain(q, k, v, valid[:, None, None, :]).forward_kernel


def test_the_kernel_builds_where_nothing_is_missing() -> None:
    # on a machine with AMX, AVX-512 and a compiler the kernel must build and pass its
    # self-check (a float64 comparison): otherwise every test above would quietly test SDPA
    static = compiled.static_reason(DTYPE, CPU)
    if static is not None:
        assert short_bf16.unavailable_reason(DTYPE, CPU) == static
        return
    q = torch.randn(1, 1, 3, 32).to(DTYPE)
    out = short_bf16.forward(q, q, q, torch.tensor([[True, False, False]]), 1.0)
    assert short_bf16.unavailable_reason(DTYPE, CPU) is None
    assert out is not None and out.shape == (1, 1, 3, 32)
    assert torch.equal(out[0, 0], q[0, 0, :1].expand(3, 32))  # every query sees key 0 only
