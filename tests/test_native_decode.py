"""The compiled decode kernel (`qkv.native.decode`) and its place in the decode backend.

Expected values come from backend="math" in float64 (`qkv.attention`), never from the kernel.
Each numeric test runs the AVX2 build (which runs on any higher machine) and the build of the
tier qkv uses here; a spy on the kernel's entry point checks that it really ran (a failed build
would otherwise pass through the PyTorch ops unseen).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch

import qkv
from qkv import _log
from qkv import masks as M
from qkv.attention.dispatch import choose_path
from qkv.attention.problem import describe_problem
from qkv.backends import decode as decode_backend
from qkv.native import build as compiled
from qkv.native import decode as native
from qkv.native.machine import TIER_VARIABLE

BF16 = torch.bfloat16
CPU = torch.device("cpu")
# the builds under test: AVX2 (any x86-64 machine of qkv's avx2 tier or above) and the one
# for the tier qkv uses here (the machine's, or QKV_CPU_TIER's)
TIER_CASES = ("avx2", "machine")


def _skip_reason(dtype: torch.dtype, tier: str | None) -> str | None:
    """Why the kernel cannot run here at all (no compiler, QKV_NO_COMPILED_KERNELS, a tier
    without AVX2): facts of the machine, not of the kernel. A failed build is not a reason:
    the spy then sees no run and the test fails."""
    return compiled.tier_reason(native.TIERS, dtype, CPU, native.DTYPES, tier)


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The tiers the kernel ran at (its entry point wrapped; a run that returned None is not one)."""
    runs: list[str] = []
    real = native.forward

    def recorded(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        if result is not None:
            runs.append(native._tier(kwargs.get("tier")) or "?")
        return result

    monkeypatch.setattr(native, "forward", recorded)
    return runs


def _use_tier(monkeypatch: pytest.MonkeyPatch, tier: str) -> bool:
    """Run the build of ``tier`` ("machine": the tier qkv uses now) through the decode backend;
    whether it can run here. Where it cannot (QKV_NO_COMPILED_KERNELS, no compiler, a tier
    without AVX2) the same checks hold for its fallback, the PyTorch ops, and the spy sees no run."""
    if tier != "machine":
        monkeypatch.setenv(TIER_VARIABLE, tier)
    return _skip_reason(BF16, None) is None


def _inputs(N: int, H: int, G: int, L: int, S: int, E: int, Ev: int, dtype: torch.dtype, seed: int = 0, spare: int = 7):
    """q (N, H, L, E) strided like a projection's heads; k, v (N, G, S, E | Ev) the filled
    prefix of a cache with ``spare`` more positions of capacity."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(N, L, H, E, generator=gen).to(dtype).transpose(1, 2)  # (N, H, L, E)
    k = torch.randn(N, G, S + spare, E, generator=gen).to(dtype)[:, :, :S]  # (N, G, S, E)
    v = torch.randn(N, G, S + spare, Ev, generator=gen).to(dtype)[:, :, :S]  # (N, G, S, Ev)
    return q, k, v


def _reference(q, k, v, mask, sinks=None) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """backend="math" in float64: (output, lse)."""
    wide_sinks = None if sinks is None else sinks.double()
    return qkv.attention(q.double(), k.double(), v.double(), mask, backend="math", return_lse=True, sinks=wide_sinks)


def _tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == BF16 else 2e-5


SIZES = [1, 17, 1025, 4097]


@pytest.mark.parametrize("tier", TIER_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("S", SIZES)
def test_it_matches_float64_math(monkeypatch: pytest.MonkeyPatch, ran: list[str], tier: str, dtype: torch.dtype, S: int) -> None:
    """GQA 6 / 2, three queries bottom-right causal, split counts that do not divide S, a head
    dim that is not a multiple of a vector and a value width of its own."""
    runs = _use_tier(monkeypatch, tier)
    q, k, v = _inputs(2, 6, 2, 3, S, 72, 40, dtype)
    want, want_lse = _reference(q, k, v, M.causal())
    for splits in (1, 3, 7):
        out, lse = decode_backend.decode_attention(q, k, v, 72**-0.5, M.causal(), splits=splits, kernel="native_decode")
        assert out.dtype == dtype and lse.dtype == torch.float32
        torch.testing.assert_close(out.double(), want, atol=_tolerance(dtype), rtol=0)
        torch.testing.assert_close(lse.double(), want_lse, atol=_tolerance(dtype), rtol=0)
    assert ran == ([native._tier(None)] * 3 if runs else [])  # the build of the tier asked for
    if tier == "avx2" and runs:
        assert ran == ["avx2"] * 3


@pytest.mark.parametrize("tier", TIER_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_a_query_strided_along_its_head_dim(monkeypatch: pytest.MonkeyPatch, ran: list[str], tier: str, dtype: torch.dtype) -> None:
    """q (N, H, L, E) as the transpose of an (N, H, E, L) tensor: its last dim has stride L, not
    1 (k and v keep unit strides there). Through `qkv.attention`, against float64 math."""
    runs = _use_tier(monkeypatch, tier)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 40, 3, generator=gen).to(dtype).transpose(2, 3)  # (1, 4, 3, 40), stride 3 along E
    _, k, v = _inputs(1, 4, 2, 3, 1500, 40, 24, dtype, seed=8)
    assert q.stride(-1) != 1
    want = qkv.attention(q.double(), k.double(), v.double(), M.causal(), backend="math")
    out = qkv.attention(q, k, v, M.causal())
    torch.testing.assert_close(out.double(), want, atol=_tolerance(dtype), rtol=0)
    assert ran == ([native._tier(None)] if runs else [])


@pytest.mark.parametrize("tier", TIER_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_a_window_shorter_than_a_split_and_sinks(monkeypatch: pytest.MonkeyPatch, ran: list[str], tier: str, dtype: torch.dtype) -> None:
    """A 40-key window over 4,097 keys in 3 splits of 1,366: most splits see nothing for most
    rows; the sinks join every row's denominator and its lse."""
    runs = _use_tier(monkeypatch, tier)
    q, k, v = _inputs(1, 6, 2, 4, 4097, 64, 64, dtype, seed=1)
    sinks = torch.tensor([[0.5, -1.0, 2.0, 0.0, 8.0, -3.0]])  # (1, H)
    mask = M.sliding_window(40)
    want, want_lse = _reference(q, k, v, mask, sinks)
    out, lse = decode_backend.decode_attention(q, k, v, 64**-0.5, mask, sinks=sinks, splits=3, kernel="native_decode")
    torch.testing.assert_close(out.double(), want, atol=_tolerance(dtype), rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=_tolerance(dtype), rtol=0)
    assert len(ran) == (1 if runs else 0)


@pytest.mark.parametrize("tier", TIER_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_rows_with_no_visible_key_give_zeros_and_lse_minus_infinity(
    monkeypatch: pytest.MonkeyPatch, ran: list[str], tier: str, dtype: torch.dtype
) -> None:
    """Key padding: batch row 1 sees no key (zeros, lse -inf, sink or not), row 0 every other key."""
    runs = _use_tier(monkeypatch, tier)
    q, k, v = _inputs(2, 4, 2, 2, 1025, 32, 32, dtype, seed=2)
    valid = torch.zeros(2, 1025, dtype=torch.bool)
    valid[0, ::2] = True
    mask = M.key_padding(valid)
    sinks = torch.full((2, 4), 1.5)
    want, want_lse = _reference(q, k, v, mask, sinks)
    out, lse = decode_backend.decode_attention(q, k, v, 32**-0.5, mask, sinks=sinks, splits=4, kernel="native_decode")
    assert bool((out[1] == 0).all()) and bool(torch.isneginf(lse[1]).all())
    assert bool(torch.isneginf(want_lse[1]).all())  # the reference agrees, independently
    torch.testing.assert_close(out.double(), want, atol=_tolerance(dtype), rtol=0)
    torch.testing.assert_close(lse[0].double(), want_lse[0], atol=_tolerance(dtype), rtol=0)
    assert len(ran) == (1 if runs else 0)


@pytest.mark.parametrize("tier", TIER_CASES)
def test_causal_queries_before_the_first_key_give_empty_rows(monkeypatch: pytest.MonkeyPatch, ran: list[str], tier: str) -> None:
    """Five queries, three keys, bottom-right causal: queries 0 and 1 see no key (their own
    intervals are empty), the others one, two and three keys."""
    runs = _use_tier(monkeypatch, tier)
    q, k, v = _inputs(1, 2, 1, 5, 3, 16, 16, torch.float32, seed=3)
    want, want_lse = _reference(q, k, v, M.causal())
    assert bool(torch.isneginf(want_lse[:, :, :2]).all())
    out, lse = decode_backend.decode_attention(q, k, v, 0.25, M.causal(), splits=2, kernel="native_decode")
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=0)
    assert len(ran) == (1 if runs else 0)


@pytest.mark.parametrize("tier", TIER_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_two_runs_are_bitwise_equal(monkeypatch: pytest.MonkeyPatch, ran: list[str], tier: str, dtype: torch.dtype) -> None:
    runs = _use_tier(monkeypatch, tier)
    q, k, v = _inputs(1, 8, 2, 1, 4097, 128, 128, dtype, seed=4)
    first = decode_backend.decode_attention(q, k, v, 128**-0.5, splits=5, kernel="native_decode")
    second = decode_backend.decode_attention(q, k, v, 128**-0.5, splits=5, kernel="native_decode")
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert len(ran) == (2 if runs else 0)


def test_the_avx2_build_and_the_machines_are_separate_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier is part of the build's flags and cache key: a forced tier never loads another's library."""
    monkeypatch.delenv("QKV_NO_COMPILED_KERNELS", raising=False)  # it would be the first reason given
    avx2, avx512 = native._TIERED.kernel("avx2"), native._TIERED.kernel("avx512")
    assert "tier avx2" in compiled.cache_key(avx2) and "tier avx512" in compiled.cache_key(avx512)
    assert avx2.folder() != avx512.folder()
    assert not any(flag.startswith("-mavx512") for flag in avx2.cflags)
    assert compiled.build_tier(native.TIERS, "amx") == "amx" and "-mavx512bf16" in native._TIERED.kernel("amx").cflags
    assert compiled.build_tier(native.TIERS, "default") is None
    assert "the kernel is built for avx2 or avx512 or amx" in (native.unavailable_reason(torch.float32, CPU, "default") or "")


def test_a_tier_above_the_machine_is_refused() -> None:
    q, k, v = _inputs(1, 2, 1, 1, 8, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="not-a-tier"):
        native.forward(q, k, v, 0.25, 0, 8, 1, tier="not-a-tier")
    if compiled.build_tier(("avx512",)) is None:  # an AVX2 machine (or a forced tier): avx512 is above it
        with pytest.raises(ValueError, match="above this machine"):
            native.forward(q, k, v, 0.25, 0, 8, 1, tier="avx512")


def test_bad_arguments_are_named_before_the_kernel_reads_memory() -> None:
    if _skip_reason(torch.float32, None) is not None:
        pytest.skip("the native decode kernel cannot run here")
    q, k, v = _inputs(1, 4, 2, 1, 32, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="share one dtype"):
        torch.ops.qkv.decode(q, k.to(BF16), v, 0.25, 0, 32, 1, None, None, None, None, "")
    with pytest.raises(ValueError, match="is not a range"):
        torch.ops.qkv.decode(q, k, v, 0.25, 0, 33, 1, None, None, None, None, "")
    with pytest.raises(ValueError, match="lo must be int64"):
        torch.ops.qkv.decode(q, k, v, 0.25, 0, 32, 1, torch.zeros(1, 2), torch.zeros(1, 2), None, None, "")


def test_the_operator_gives_what_the_direct_call_gives() -> None:
    if _skip_reason(torch.float32, None) is not None:
        pytest.skip("the native decode kernel cannot run here")
    q, k, v = _inputs(1, 4, 2, 2, 300, 16, 16, torch.float32, seed=5)
    direct = native.forward(q, k, v, 0.25, 0, 300, 2)
    assert direct is not None
    through = torch.ops.qkv.decode(q, k, v, 0.25, 0, 300, 2, None, None, None, None, "")
    assert torch.equal(direct[0], through[0]) and torch.equal(direct[1], through[1])


def _plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None, **kwargs: Any):  # type: ignore[no-untyped-def]
    return choose_path(describe_problem(q, k, v, mask, **kwargs), "auto", False, False)


def test_the_plan_names_the_kernel_and_the_kernel_runs(monkeypatch: pytest.MonkeyPatch, ran: list[str]) -> None:
    """backend="auto" at a decode step without gradient: the Plan names native_decode, explain
    says so, the kernel runs and the PyTorch ops do not; switched off, the reverse."""
    if _skip_reason(torch.float32, None) is not None:
        pytest.skip("the native decode kernel cannot run here")
    portable: list[int] = []
    real = decode_backend.decode_runs
    monkeypatch.setattr(decode_backend, "decode_runs", lambda *a, **kw: portable.append(1) or real(*a, **kw))
    q, k, v = _inputs(1, 8, 2, 1, 2048, 64, 64, torch.float32, seed=6)
    want = _reference(q, k, v, M.causal())[0]
    plan = _plan(q, k, v, M.causal())
    assert (plan.path, plan.forward_kernel, plan.backward_kernel, plan.forward_absent) == ("decode", "native_decode", "none", None)
    assert "native decode kernel" in str(qkv.explain(q, k, v, M.causal()))
    out = qkv.attention(q, k, v, M.causal())
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)
    assert len(ran) == 1 and not portable
    with qkv.backends.disabled("native_decode"):
        plan = _plan(q, k, v, M.causal())
        assert plan.forward_kernel == "decode" and "switched off" in (plan.forward_absent or "")
        assert "does not run: it is switched off" in str(qkv.explain(q, k, v, M.causal()))
        out = qkv.attention(q, k, v, M.causal())
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)
    assert len(ran) == 1 and portable


def test_gradients_and_biases_keep_the_pytorch_ops(ran: list[str]) -> None:
    q, k, v = _inputs(1, 4, 2, 1, 2048, 32, 32, torch.float32, seed=7)
    plan = _plan(q, k.requires_grad_(), v)
    assert plan.forward_kernel == "decode" and plan.backward_kernel == "decode"
    assert plan.forward_absent == "a gradient is needed (it runs forward only)"
    out = qkv.attention(q, k, v)
    out.sum().backward()
    assert k.grad is not None and not ran
    plan = _plan(q, k.detach(), v, None, bias=qkv.bias.dense(torch.zeros(1, 4, 1, 2048)))
    assert plan.forward_kernel == "decode" and "score terms" in (plan.forward_absent or "")
    plan = _plan(q, k.detach(), v, None, bias=qkv.bias.alibi(torch.ones(4, requires_grad=True)))
    assert plan.forward_kernel == "decode" and "gradient" in (plan.forward_absent or "")


def test_no_compiled_kernels_keeps_the_pytorch_ops(monkeypatch: pytest.MonkeyPatch, ran: list[str]) -> None:
    monkeypatch.setenv("QKV_NO_COMPILED_KERNELS", "1")
    q, k, v = _inputs(1, 4, 2, 1, 2048, 32, 32, torch.float32, seed=8)
    plan = _plan(q, k, v)
    assert plan.forward_kernel == "decode" and plan.forward_absent == "QKV_NO_COMPILED_KERNELS is set"
    with torch.no_grad():
        qkv.attention(q, k, v)
    assert not ran


def test_a_failed_build_falls_back_with_one_note(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A build whose self-check fails (as a wrong instruction would): the call still gives the
    right answer through the PyTorch ops, says why once, and later plans name the PyTorch ops."""
    if _skip_reason(torch.float32, None) is not None:
        pytest.skip("the native decode kernel cannot run here")
    monkeypatch.setattr(native._TIERED, "builds", {})  # this process's build attempts, forgotten
    monkeypatch.setattr(_log, "_noted", set())  # and the causes noted so far
    monkeypatch.setattr(native, "_check", lambda library: "its self-check failed (made to fail by the test)")
    q, k, v = _inputs(1, 4, 2, 1, 2048, 32, 32, torch.float32, seed=9)
    want = _reference(q, k, v, None)[0]
    assert _plan(q, k, v).forward_kernel == "native_decode"
    with caplog.at_level(logging.INFO, logger="qkv"), torch.no_grad():
        out = qkv.attention(q, k, v)
        qkv.attention(q, k, v)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)
    notes = [r.getMessage() for r in caplog.records if "made to fail" in r.getMessage()]
    assert len(notes) == 1 and "the native decode kernel is not used" in notes[0]
    plan = _plan(q, k, v)
    assert plan.forward_kernel == "decode" and "made to fail" in (plan.forward_absent or "")


def test_default_split_counts_depend_on_sizes_and_threads_only() -> None:
    assert decode_backend.fused_splits(32768, 8, threads=2) == 1
    assert decode_backend.fused_splits(32768, 8, threads=16) == 8
    assert decode_backend.fused_splits(17, 8, threads=16) == 1
    assert math.ceil(4097 / decode_backend.fused_splits(4097, 1, threads=4)) * decode_backend.fused_splits(4097, 1, threads=4) >= 4097
