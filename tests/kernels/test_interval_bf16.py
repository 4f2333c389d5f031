"""The fused bf16 interval kernel (`qkv.native.interval_bf16`) and its fallback.

Its forward goes through the whole engine (`qkv.attention(..., backend="blocks")`), so the
backward (the engine's own, from the kernel's output and lse) is checked too, against the
float64 reference by docs/design.md's tolerance rule (`assert_by_the_rule`). A spy counts the
kernel's calls, so a test fails if the kernel silently stops running on a machine that can
run it. On a machine that cannot (no AVX-512 BF16, no compiler), the same tests check the fallback
(the per-tile flash path) and that a reason is given.

The first test to need the kernel builds it (seconds, once per source version; the build
folder is named by the source's hash, so no earlier build of another source is used).
"""

from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import qkv
from qkv import masks as M
from qkv.native import build as compiled
from qkv.native import interval_bf16
from qkv.native.machine import cpu_features
from tests.kernels._compiler import REASON as FAILED_BUILD
from tests.kernels._compiler import forget_builds, use_failing_compiler
from tests.kernels._spy import CallSpy
from tests.kernels.test_blocks import _problem, _reference
from tests.kernels.test_blocks_bf16 import DTYPE, FLOOR, _err, _naive, assert_by_the_rule

CPU = torch.device("cpu")


def _can_run() -> bool:
    return interval_bf16.unavailable_reason(DTYPE, CPU) is None


def _spy(monkeypatch: pytest.MonkeyPatch) -> CallSpy:
    """Counts the kernel's calls that returned a result."""
    return CallSpy(monkeypatch, interval_bf16, "forward")


def _ids(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


# (N, H, G, L, S, E, Ev, mask(N, L, S)): awkward sizes, every mask with row intervals
CASES = {
    "window-97x1025": (1, 2, 2, 97, 1025, 64, 64, lambda N, L, S: M.sliding_window(256, 256)),
    "window-1025x97-E59": (1, 2, 2, 1025, 97, 59, 59, lambda N, L, S: M.sliding_window(30, 5)),
    "causal-300-E128-Ev64": (2, 2, 1, 300, 300, 128, 64, lambda N, L, S: M.causal()),
    "causal-one-query": (1, 4, 2, 1, 700, 64, 64, lambda N, L, S: M.causal()),
    "gqa-6-2-window-E64-Ev128": (1, 6, 2, 200, 200, 64, 128, lambda N, L, S: M.sliding_window(40, 0)),
    "documents&causal": (1, 2, 2, 260, 260, 32, 32, lambda N, L, S: M.documents(_ids([1, 100, 64, 95])) & M.causal()),
    "key-padding-empty-rows": (2, 2, 2, 70, 150, 64, 40, lambda N, L, S: M.key_padding(torch.tensor([0, 77]))),
    "prefix-no-keys-for-some": (1, 1, 1, 130, 130, 64, 64, lambda N, L, S: M.prefix_lm(3) & M.sliding_window(0, 5)),
    "no-mask": (1, 2, 2, 65, 129, 64, 64, lambda N, L, S: None),
    # spans past 1,024 keys: online softmax steps of 512 keys with rescaling, a short last step
    "no-mask-long-span-online": (1, 1, 1, 70, 2100, 64, 48, lambda N, L, S: None),
    "causal-long-diagonals-E96": (1, 1, 1, 1300, 1300, 96, 96, lambda N, L, S: M.causal()),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_by_the_tolerance_rule(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    N, H, G, L, S, E, Ev, make = CASES[case]
    q, k, v, d_out = _problem(N, H, G, L, S, E, Ev, seed=5)
    mask = make(N, L, S)
    dense_mask = mask if mask is not None else M.dense(torch.ones(1, 1, L, S, dtype=torch.bool))
    scale = E**-0.5
    trace, ref_grads = _reference(q, k, v, dense_mask, d_out, scale)
    spy = _spy(monkeypatch)
    results = {}
    for name, fn in {
        "blocks": lambda a, b, c: qkv.attention(a, b, c, mask, backend="blocks", scale=scale),
        "naive": lambda a, b, c: _naive(a, b, c, dense_mask.to_dense(L, S), scale),
    }.items():
        ql, kl, vl = (t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
        out = fn(ql, kl, vl)
        results[name] = out, torch.autograd.grad(out, (ql, kl, vl), d_out.to(DTYPE))
    assert_by_the_rule(*results["blocks"], *results["naive"], trace.output, ref_grads)
    assert spy.calls == (1 if _can_run() else 0)


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("case", ["window-97x1025", "window-1025x97-E59", "gqa-6-2-window-E64-Ev128",
                                  "key-padding-empty-rows", "no-mask-long-span-online"])
def test_inference_output_by_the_tolerance_rule(case: str, sign: float, monkeypatch: pytest.MonkeyPatch) -> None:
    # without a backward the kernel writes its output in bf16 itself (no float32 copy to
    # round); a negative scale makes its max pass look for each row's lowest raw score
    N, H, G, L, S, E, Ev, make = CASES[case]
    q, k, v, d_out = _problem(N, H, G, L, S, E, Ev, seed=6)
    mask = make(N, L, S)
    dense_mask = mask if mask is not None else M.dense(torch.ones(1, 1, L, S, dtype=torch.bool))
    scale = sign * E**-0.5
    trace = _reference(q, k, v, dense_mask, d_out, scale)[0]
    spy = _spy(monkeypatch)
    ql, kl, vl = (t.to(DTYPE) for t in (q, k, v))
    with torch.no_grad():
        out, lse = qkv.attention(ql, kl, vl, mask, backend="blocks", scale=scale, return_lse=True)
        naive = _naive(ql, kl, vl, dense_mask.to_dense(L, S), scale)
    assert out.dtype == DTYPE and lse.dtype == torch.float32
    assert _err(out, trace.output) <= 2 * _err(naive, trace.output) + FLOOR
    # lse against float64 math on the same bf16 inputs: float32 rounding alone remains
    rounded = _reference(ql.double(), kl.double(), vl.double(), dense_mask, d_out, scale)[0]
    assert np.array_equal(np.isneginf(lse.numpy()), np.isneginf(rounded.lse))
    finite = np.isfinite(rounded.lse)
    assert np.abs(lse.double().numpy()[finite] - rounded.lse[finite]).max() < 1e-4
    assert spy.calls == (1 if _can_run() else 0)


def test_inference_output_is_the_training_output_rounded() -> None:
    # the bf16 output written by the kernel is its float32 output rounded to nearest even
    N, H, L, S, E = 1, 2, 300, 300, 64
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(N, H, T, E, generator=gen).to(DTYPE) for T in (L, S, S))
    mask = M.sliding_window(60, 10)
    with torch.no_grad():
        inference, inference_lse = qkv.attention(q, k, v, mask, backend="blocks", return_lse=True)
    trained = [t.clone().requires_grad_(True) for t in (q, k, v)]
    training, training_lse = qkv.attention(*trained, mask, backend="blocks", return_lse=True)
    assert torch.equal(inference, training.detach())
    assert torch.equal(inference_lse, training_lse.detach())


def test_lse_and_empty_rows_match_float64_on_the_rounded_inputs() -> None:
    # the kernel keeps scores, softmax state and the output in float32: against float64 math
    # on the same bf16 inputs only float32 rounding and P's rounding to bf16 remain
    N, H, L, S, E = 2, 3, 200, 333, 64
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(N, H, T, E, generator=gen).to(DTYPE) for T in (L, S, S))
    mask = M.sliding_window(100, 20) & M.key_padding(torch.tensor([333, 150]))
    out, lse = qkv.attention(q, k, v, mask, backend="blocks", return_lse=True)
    visible = mask.to_dense(L, S)  # (N, 1, L, S)
    s = (q.double() @ k.double().transpose(-1, -2) * E**-0.5).masked_fill(~visible, float("-inf"))
    want_lse = torch.logsumexp(s, dim=-1)  # (N, H, L)
    want = torch.nan_to_num(torch.softmax(s, dim=-1)) @ v.double()
    empty = torch.isneginf(want_lse)
    assert bool(empty.any()) and bool((~empty).any())
    assert torch.equal(torch.isneginf(lse), empty)
    assert (lse.double() - want_lse)[~empty].abs().max() < 1e-4
    assert bool((out[empty.unsqueeze(-1).expand_as(out)] == 0).all())
    # the output is rounded to bf16 once (half an ulp, 2^-9 relative) and P to bf16 inside
    assert (out.double() - want).abs().max() < 2e-2


def test_extreme_scores_stay_exact() -> None:
    # scores of magnitude ~ 10^3 after scaling: the running max must keep exp() in range
    L = S = 300
    q, k, v, d_out = _problem(1, 2, 2, L, S, 64, 64, seed=9)
    q, k = q * 12, k * 12
    mask = M.sliding_window(70, 70)
    trace, ref_grads = _reference(q, k, v, mask, d_out, 0.125)
    naive_in = [t.to(DTYPE).requires_grad_(True) for t in (q, k, v)]
    naive = _naive(*naive_in, mask.to_dense(L, S), 0.125)
    naive_grads = torch.autograd.grad(naive, naive_in, d_out.to(DTYPE))
    ql, kl, vl = (t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
    out = qkv.attention(ql, kl, vl, mask, backend="blocks", scale=0.125)
    assert torch.isfinite(out).all()
    grads = torch.autograd.grad(out, (ql, kl, vl), d_out.to(DTYPE))
    assert_by_the_rule(out, grads, naive, naive_grads, trace.output, ref_grads)


@pytest.mark.parametrize(("size", "n", "mask"), [(3e4, 64, M.causal()), (1e5, 1500, M.sliding_window(1000, 1000))])
def test_huge_scores_keep_the_max_key(size: float, n: int, mask: M.Mask) -> None:
    # scaled scores ~ 1e9 to 1e10: exp's argument for each row's max key must be exactly 0
    # (the product once entered exp unrounded, by an fmsub: its rounding error, ~ulp(1e9) = 64,
    # gave NaN or zero rows). Self-attention, so each row's own key has the top score; the
    # window's rows see up to 2,001 keys: the one-step and the online softmax both run.
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(1, 2, n, 64, generator=gen) * size).to(DTYPE)
    v = torch.randn(1, 2, n, 64, generator=gen).to(DTYPE)
    with torch.no_grad():
        out = qkv.attention(q, q, v, mask, backend="blocks")
    want = _reference(q.double(), q.double(), v.double(), mask, torch.zeros(1, 2, n, 64, dtype=torch.float64), 0.125)[0]
    assert torch.isfinite(out).all()
    assert _err(out, want.output) <= 2e-2  # the own key's value, rounded to bf16


@pytest.mark.parametrize("mask", [M.sliding_window(37, 5), M.causal()])
def test_large_scores_pick_the_top_keys_value_exactly(mask: M.Mask) -> None:
    # scaled scores ~ 3e5 (about 2^18.8 in base 2): each row's own key outweighs the others by
    # e^(1e5), so every output row is exactly its own value. An fmsub of the unrounded product
    # leaves the top key's exponent up to ulp(2^19) / 2 = 2^-5 away from 0, enough to turn its
    # bf16 probability into 1.0078 (one value off by an ulp in many rows); the kernel takes that
    # shortcut only while the product's rounding cannot change a bf16 probability of 1.
    gen = torch.Generator().manual_seed(0)
    n = 600
    q = (torch.randn(1, 2, n, 64, generator=gen) * 200).to(DTYPE)
    v = torch.randn(1, 2, n, 24, generator=gen).to(DTYPE)
    scores = q.double() @ q.double().transpose(-1, -2) * 0.125  # (1, 2, n, n)
    own = scores.diagonal(dim1=-2, dim2=-1)  # (1, 2, n)
    others = scores.masked_fill(torch.eye(n, dtype=torch.bool), float("-inf")).amax(dim=-1)  # (1, 2, n)
    assert bool((own - others > 1e4).all()) and 2**17 < float(own.max()) * math.log2(math.e) < 2**20
    with torch.no_grad():
        out = qkv.attention(q, q, v, mask, scale=0.125, backend="blocks")
    assert torch.equal(out, v)


def test_fallback_gives_the_same_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 1100
    q, k, v, _ = _problem(1, 2, 2, n, n, 64, 64, seed=2)
    q, k, v = (t.to(DTYPE) for t in (q, k, v))
    mask = M.sliding_window(256, 256)
    trace = _reference(q.double(), k.double(), v.double(), mask, torch.zeros(1, 2, n, 64, dtype=torch.float64), 0.125)[0]
    fused, fused_lse = qkv.attention(q, k, v, mask, scale=0.125, return_lse=True)
    spy = _spy(monkeypatch)
    with qkv.backends.disabled("interval_bf16"):
        # the engine's own fallback (at this size 'auto' would estimate SDPA faster than the portable tiles)
        tiles, tiles_lse = qkv.attention(q, k, v, mask, scale=0.125, return_lse=True, backend="blocks")
        explained = qkv.explain(q, k, v, mask, backend="blocks")
    assert spy.calls == 0
    assert 'switched off (qkv.backends.disabled("interval_bf16"))' in explained.forward_kernel
    # both paths see the same bf16 inputs: each within the rounding of its bf16 output
    for out in (fused, tiles):
        assert _err(out, trace.output) < 1e-2
    np.testing.assert_allclose(fused_lse.numpy(), tiles_lse.numpy(), atol=1e-4, rtol=1e-5)


def test_explain_names_the_kernel_or_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 2, 3000, 64).to(DTYPE)
    mask = M.sliding_window(100, 100)
    text = str(qkv.explain(q, q, q, mask))
    if _can_run():
        assert f"forward kernel: the {interval_bf16.KERNEL_NAME}" in text
    else:
        assert "does not run: " in text
    assert qkv.explain(q.float(), q.float(), q.float(), mask).forward_kernel == ""  # float32: nothing to say
    per_head = M.predicate(lambda b, h, i, j: (i - j).abs() < 50, heads=2)
    with monkeypatch.context() as able:  # as on a machine that could run it (explain builds nothing)
        able.setattr(compiled, "static_reason", lambda *args, **kwargs: None)
        assert "one key interval per query" in qkv.explain(q, q, q, per_head, backend="blocks").forward_kernel
    monkeypatch.delenv("QKV_NO_COMPILED_KERNELS", raising=False)  # its own reason would come first
    monkeypatch.setenv("QKV_CPU_TIER", "avx2")  # as on an AVX2 machine, whatever this one is
    assert "this CPU's tier is avx2" in qkv.explain(q, q, q, mask).forward_kernel
    assert "the kernel needs AVX-512 BF16 (tier avx512 or amx)" in interval_bf16.unavailable_reason(DTYPE, CPU)  # type: ignore[operator]


def test_onednn_switched_off_falls_back_without_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    # both kernels call oneDNN's micro-kernels, which refuse bf16 while torch.backends.mkldnn is
    # off: that is checked on every call (the kernels may have been built before it was switched)
    q, k, v, d_out = _problem(1, 2, 2, 200, 200, 64, 64, seed=5)
    mask = M.sliding_window(40, 40)
    trace, ref_grads = _reference(q, k, v, mask, d_out, 0.125)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    ql, kl, vl = (t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
    explained = qkv.explain(ql, kl, vl, mask, backend="blocks")
    if compiled.static_reason(DTYPE, CPU) is None:  # a machine that could run their amx builds
        assert "oneDNN is switched off" in explained.forward_kernel
        assert "oneDNN is switched off" in explained.backward_kernel
    elif compiled.interval_tier() == "avx512" and _can_run():  # their own micro-kernel needs no oneDNN
        assert "does not run" not in explained.forward_kernel + explained.backward_kernel
    out = qkv.attention(ql, kl, vl, mask, backend="blocks", scale=0.125)
    grads = torch.autograd.grad(out, (ql, kl, vl), d_out.to(DTYPE))
    assert _err(out, trace.output) < 2e-2
    for got, want in zip(grads, ref_grads, strict=True):
        assert _err(got, want) < 5e-2


def test_no_compiled_kernels_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QKV_NO_COMPILED_KERNELS", "1")
    assert interval_bf16.unavailable_reason(DTYPE, CPU) == "QKV_NO_COMPILED_KERNELS is set"
    q = torch.randn(1, 1, 64, 32).to(DTYPE)
    assert interval_bf16.forward(q, q, q, torch.zeros(1, 64, dtype=torch.long), torch.zeros(1, 64, dtype=torch.long), 1.0) is None


def test_a_failed_build_is_a_reason_not_a_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    use_failing_compiler(monkeypatch, tmp_path)
    forget_builds(monkeypatch, interval_bf16)
    monkeypatch.setattr(interval_bf16, "_static_reason", lambda dtype, device: None)  # as on a machine that could run it
    q, k, v, d_out = _problem(1, 2, 2, 300, 300, 64, 64, seed=4)
    mask = M.sliding_window(64, 64)
    trace, _ = _reference(q, k, v, mask, d_out, 0.125)
    out = qkv.attention(q.to(DTYPE), k.to(DTYPE), v.to(DTYPE), mask, backend="blocks", scale=0.125)
    assert _err(out, trace.output) < 2e-2  # the per-tile path ran
    reason = interval_bf16.unavailable_reason(DTYPE, CPU)
    assert reason == FAILED_BUILD
    assert reason in qkv.explain(q.to(DTYPE), k.to(DTYPE), v.to(DTYPE), mask, backend="blocks").forward_kernel


def test_the_build_goes_where_torch_extensions_dir_says(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    use_failing_compiler(monkeypatch, tmp_path)
    forget_builds(monkeypatch, interval_bf16)
    assert interval_bf16._KERNEL.build() == FAILED_BUILD
    folder = interval_bf16._KERNEL.native().folder()
    assert folder.parent == tmp_path / "cache" and folder.name.startswith("qkv_interval_bf16_")
    assert not interval_bf16._KERNEL.native().is_built()


@pytest.mark.parametrize("tier", ["amx", "avx512"])
def test_each_tier_loads_its_own_build(monkeypatch: pytest.MonkeyPatch, tier: str) -> None:
    """The build that runs is the tier's: oneDNN's AMX micro-kernel on ``amx``, the kernel's own
    AVX-512 BF16 one on ``avx512`` (forced on an AMX machine), and the two are told apart by
    their libraries; both agree with float64 math."""
    monkeypatch.setenv("QKV_CPU_TIER", tier)
    monkeypatch.delenv("QKV_NO_COMPILED_KERNELS", raising=False)
    if cpu_features().tier != tier or interval_bf16._static_reason(DTYPE, CPU) is not None:
        # a machine below this tier (the forced tier is ignored) or without a compiler
        pytest.skip(f"the {tier} build cannot run here: `test_the_kernel_builds_where_nothing_is_missing` says why")
    held = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if tier == "amx" and held not in ("", "ALL", "DEFAULT") and "AMX" not in held:
        pytest.skip(f"oneDNN is held below AMX in this process (ONEDNN_MAX_CPU_ISA={held}), which the amx build calls")
    assert compiled.interval_tier() == tier and interval_bf16._KERNEL.native() is interval_bf16.BUILDS[tier]
    q, k, v, d_out = _problem(1, 2, 2, 150, 150, 64, 64, seed=21)
    mask = M.sliding_window(40, 20)
    trace, _ = _reference(q, k, v, mask, d_out, 0.125)
    spy = _spy(monkeypatch)
    with torch.no_grad():
        out = qkv.attention(q.to(DTYPE), k.to(DTYPE), v.to(DTYPE), mask, backend="blocks", scale=0.125)
    assert spy.calls == 1 and _err(out, trace.output) < 2e-2
    library = interval_bf16._KERNEL.build_state()["module"]
    assert isinstance(library, ctypes.CDLL)
    assert Path(library._name).parent == interval_bf16.BUILDS[tier].folder()


def test_the_kernel_builds_where_nothing_is_missing() -> None:
    # on a machine with AVX-512 BF16 (tier avx512 or amx) and a compiler the kernel must build and pass its
    # self-check (a float64 comparison): otherwise every test above would quietly test the fallback
    if interval_bf16._static_reason(DTYPE, CPU) is not None:
        assert interval_bf16.unavailable_reason(DTYPE, CPU) == interval_bf16._static_reason(DTYPE, CPU)
        return
    q = torch.randn(1, 1, 64, 32).to(DTYPE)
    lo, hi = torch.zeros(1, 64, dtype=torch.long), torch.arange(64).view(1, 64)  # causal
    result = interval_bf16.forward(q, q, q, lo, hi, 1.0)
    assert interval_bf16.unavailable_reason(DTYPE, CPU) is None
    assert result is not None
    out, lse = result
    assert out.shape == (1, 1, 64, 32) and lse.shape == (1, 1, 64)
    torch.testing.assert_close(out[0, 0, 0], q[0, 0, 0].float())  # the first query sees one key
