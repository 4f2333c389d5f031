"""The short-sequence bf16 kernel with float32 products (`qkv.native.short_wide`), its dispatch
on CPUs without AMX (bf16 emulated, or native without AMX) and its fallback.

Each tier's build (AVX2, AVX-512) runs on any machine at or above that tier, so both are
checked on an AMX machine too; `qkv.attention` is checked on the avx2 tier forced with
``QKV_CPU_TIER`` (bf16 products emulated, as on an AMD EPYC). Outputs are compared with the
float64 reference by docs/design.md's tolerance rule (twice the error of a naive bf16
implementation, plus a floor), and every case also within half a bf16 ulp
of float64.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import qkv
from qkv import _log
from qkv.attention.dispatch import short_widens_itself
from qkv.native import build as compiled
from qkv.native import short_wide
from qkv.native.machine import TIERS, compute_dtype, cpu_features
from tests.kernels._compiler import REASON as FAILED_BUILD
from tests.kernels._compiler import use_failing_compiler
from tests.kernels._spy import CallSpy
from tests.kernels.test_blocks import _problem
from tests.kernels.test_blocks_bf16 import DTYPE, FLOOR, _err, _naive
from tests.kernels.test_short_bf16 import CASES, _reference, _valid

CPU = torch.device("cpu")


def _runs_here(tier: str) -> bool:
    """Whether ``tier``'s build may run on this machine (its tier or a lower one)."""
    return TIERS.index(tier) <= TIERS.index(cpu_features().tier)


def _refused(tier: str, *args: object) -> bool:
    """Where ``tier``'s build cannot run (``QKV_NO_COMPILED_KERNELS``, no compiler): whether the
    kernel then says why and returns None for ``args`` (q, k, v, key_valid, scale), as its
    callers expect. False where it can run."""
    reason = short_wide.unavailable_reason(DTYPE, CPU, tier)
    if reason is None:
        return False
    assert short_wide.forward(*args, tier=tier) is None  # type: ignore[arg-type]
    return True


def _within_half_an_ulp(out: torch.Tensor, want: object) -> bool:
    """float32 products and sums, one rounding to bf16: within half a bf16 ulp of float64, at
    most 2^-8 of the value (8 significant bits), plus float32's own error, far below it."""
    exact = torch.as_tensor(want)
    return bool(((out.double() - exact).abs() <= 2.0**-8 * exact.abs() * 1.01 + 1e-6).all())


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The avx2 tier, where bf16 products are emulated, whatever this machine is."""
    monkeypatch.setenv("QKV_CPU_TIER", "avx2")
    monkeypatch.delenv("QKV_KEEP_EMULATED_DTYPES", raising=False)
    monkeypatch.delenv("QKV_NO_COMPILED_KERNELS", raising=False)


def _spy(monkeypatch: pytest.MonkeyPatch) -> CallSpy:
    """Counts the kernel's calls that returned a result."""
    return CallSpy(monkeypatch, short_wide, "forward")


@pytest.mark.parametrize("tier", short_wide.TIERS)
@pytest.mark.parametrize("case", CASES)
def test_each_tier_by_the_tolerance_rule(case: str, tier: str) -> None:
    N, H, G, L, S, E, Ev, lengths = CASES[case]
    q, k, v, _ = _problem(N, H, G, L, S, E, Ev, seed=7)
    q, k, v = (x.to(DTYPE) for x in (q, k, v))
    valid = None if lengths is None else _valid(N, S, lengths)
    if not _runs_here(tier):
        with pytest.raises(ValueError, match="above this machine's tier"):
            short_wide.forward(q, k, v, valid, E**-0.5, tier=tier)
        return
    if _refused(tier, q, k, v, valid, E**-0.5):
        return
    out = short_wide.forward(q, k, v, valid, E**-0.5, tier=tier)
    assert out is not None and out.dtype == DTYPE and out.shape == (N, H, L, Ev)
    want = _reference(q, k, v, valid, E**-0.5)
    dense = torch.ones(1, 1, L, S, dtype=torch.bool) if valid is None else valid[:, None, None, :]
    assert _err(out, want) <= 2 * _err(_naive(q, k, v, dense, E**-0.5), want) + FLOOR
    assert _within_half_an_ulp(out, want)
    if valid is not None:  # rows that see no key are exact zeros
        assert bool((out[~valid.any(dim=1)] == 0).all())


@pytest.mark.parametrize("tier", [t for t in short_wide.TIERS if _runs_here(t)])
@pytest.mark.parametrize("scale", [-0.7, 1e-30, 0.125])
def test_negative_tiny_and_large_scores(tier: str, scale: float) -> None:
    # scores of magnitude ~ 10^3 with scale 0.125: the row's max keeps exp() in range
    q, k, v, _ = _problem(3, 4, 2, 21, 45, 40, 24, seed=9)
    q, k, v = (x.to(DTYPE) for x in (q * 12, k * 12, v))
    valid = _valid(3, 45, [45, 20, 1])
    if _refused(tier, q, k, v, valid, scale):
        return
    out = short_wide.forward(q, k, v, valid, scale, tier=tier)
    assert out is not None and bool(torch.isfinite(out).all())
    want = _reference(q, k, v, valid, scale)
    assert _within_half_an_ulp(out, want)


@pytest.mark.parametrize("tier", [t for t in short_wide.TIERS if _runs_here(t)])
def test_a_scale_that_would_overflow_q_alone(tier: str) -> None:
    """|q| * scale beyond float32's largest value while scale * (q . k) is small: the scores
    are scaled after the product, as qkv's overflow check bounds them (scaling q first gave
    inf, then NaN in every output)."""
    gen = torch.Generator().manual_seed(13)
    q = (torch.randn(2, 2, 9, 16, generator=gen) * 1e36).to(DTYPE)
    k = (torch.randn(2, 2, 12, 16, generator=gen) * 1e-3).to(DTYPE)
    v = torch.randn(2, 2, 12, 16, generator=gen).to(DTYPE)
    if _refused(tier, q, k, v, None, 1e3):
        return
    out = short_wide.forward(q, k, v, None, 1e3, tier=tier)
    assert out is not None and bool(torch.isfinite(out).all())
    assert _within_half_an_ulp(out, _reference(q, k, v, None, 1e3))


@pytest.mark.parametrize("tier", [t for t in short_wide.TIERS if _runs_here(t)])
def test_bits_do_not_depend_on_the_thread_count(tier: str) -> None:
    q, k, v, _ = _problem(5, 6, 3, 19, 70, 32, 32, seed=3)
    q, k, v = (x.to(DTYPE) for x in (q, k, v))
    valid = _valid(5, 70, [70, 12, 0, 33, 69])
    if _refused(tier, q, k, v, valid, 0.2):
        return
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 1):
            torch.set_num_threads(n)
            outs.append(short_wide.forward(q, k, v, valid, 0.2, tier=tier))
    finally:
        torch.set_num_threads(threads)
    assert all(o is not None and torch.equal(o, outs[0]) for o in outs)


def test_strided_views_of_a_projection_and_the_heads_side_by_side(emulated: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # q, k, v as views of one (N, L, 3, H, E) projection, as a multi-head layer makes them
    N, L, H, E = 3, 21, 4, 32
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(N, L, 3, H, E, generator=gen).to(DTYPE).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (N, H, L, E)
    valid = _valid(N, L, [21, 8, 13])
    spy = _spy(monkeypatch)
    out = qkv.attention(q, k, v, valid[:, None, None, :])
    assert spy.calls == 1
    assert _within_half_an_ulp(out, _reference(q, k, v, valid, E**-0.5))
    assert out.transpose(1, 2).is_contiguous()  # concatenating the heads copies nothing
    # transposed views (..., E, L) -> (..., L, E): the kernel reads rows, so they are copied
    q_t, k_t, v_t = (x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k, v))
    assert _within_half_an_ulp(qkv.attention(q_t, k_t, v_t, valid[:, None, None, :]), _reference(q, k, v, valid, E**-0.5))
    assert spy.calls == 2


@pytest.mark.parametrize("mask", ["none", "padding", "key_padding_valid", "key_padding_lengths"])
def test_attention_on_an_emulating_cpu_runs_it_and_says_so_once(
    emulated: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, mask: str
) -> None:
    """The kernel the Plan names is the one that runs; the float32 computation is noted once
    (information, not the warning of a dtype kept emulated)."""
    monkeypatch.setattr(_log, "_noted", set())
    caplog.set_level(logging.INFO, logger="qkv")
    q, k, v, _ = _problem(4, 6, 2, 30, 30, 32, 16, seed=5)
    q, k, v = (x.to(DTYPE) for x in (q, k, v))
    lengths = [30, 7, 0, 19]
    valid = _valid(4, 30, lengths)
    m: object = {"none": None, "padding": valid[:, None, None, :], "key_padding_valid": qkv.masks.key_padding(valid),
                 "key_padding_lengths": qkv.masks.key_padding(torch.tensor(lengths))}[mask]  # fmt: skip
    said = qkv.explain(q, k, v, m)
    assert said.forward_kernel.startswith(f"the {short_wide.KERNEL_NAME}")
    assert "bfloat16 computed in float32 on cpu" in said.shape
    spy = _spy(monkeypatch)
    for _ in range(2):
        out = qkv.attention(q, k, v, m)
    assert spy.calls == 2
    want = _reference(q, k, v, None if mask == "none" else valid, 32**-0.5)
    assert _within_half_an_ulp(out, want)
    records = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "qkv" and "bfloat16 products" in r.getMessage()]
    assert len(records) == 1 and records[0][0] == "INFO" and "computes in float32" in records[0][1]


def test_unbatched_inputs_and_the_nan_rule(emulated: None, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _spy(monkeypatch)
    q, k, v, _ = _problem(1, 4, 4, 9, 12, 32, 32, seed=6)
    q, k, v = (x[0].to(DTYPE) for x in (q, k, v))  # (H, L, E): no batch dim, 4 tasks
    out = qkv.attention(q, k, v)
    assert spy.calls == 1 and out.shape == (4, 9, 32)
    assert _within_half_an_ulp(out, _reference(q[None], k[None], v[None], None, 32**-0.5)[0])
    k = k.clone()
    k[1, 4, 0] = float("nan")  # head 1 reads it in every row
    poisoned = qkv.attention(q, k, v)
    assert spy.calls == 2  # the NaN rule cleans the inputs, then the kernel runs
    assert bool(torch.isnan(poisoned[1]).all()) and bool(torch.isfinite(poisoned[[0, 2, 3]]).all())


def _cases() -> dict[str, tuple[tuple[torch.Tensor, ...], dict[str, object]]]:
    """Calls on the avx2 tier, by name: (q, k, v), keyword arguments."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(3, 4, 10, 16, generator=gen).to(DTYPE) for _ in range(3))
    valid = _valid(3, 10, [10, 4, 7])
    long = torch.randn(2, 2, short_wide.MAX_KEYS + 1, 16, generator=gen).to(DTYPE)
    big = torch.randn(3, 2, 256, 16, generator=gen).to(DTYPE)
    trained = q.clone().requires_grad_(True)
    return {
        "none": ((q, k, v), {}),
        "padding": ((q, k, v), {"mask": valid[:, None, None, :]}),
        "padding-one-row": ((q, k, v), {"mask": valid[:1, None, None, :]}),
        "key_padding": ((q, k, v), {"mask": qkv.masks.key_padding(valid)}),
        # 256 x 256 pairs, most keys hidden: the block engine's case (`_sparse_if_it_wins`)
        "key_padding-sparse": ((big, big, big), {"mask": qkv.masks.key_padding(torch.tensor([40, 60, 30]))}),
        "causal": ((q, k, v), {"mask": qkv.masks.causal()}),
        "window": ((q, k, v), {"mask": qkv.masks.sliding_window(2, 2)}),
        "dense-bool": ((q, k, v), {"mask": torch.ones(3, 1, 10, 10, dtype=torch.bool).tril()}),
        "float-mask": ((q, k, v), {"mask": torch.zeros(3, 1, 1, 10)}),
        "padding-expanded": ((q, k, v), {"mask": valid[:, None, None, :].expand(3, 4, 10, 10)}),  # the same keys per head
        "padding-per-head": ((q, k, v), {"mask": torch.rand(3, 4, 1, 10, generator=gen) < 0.7}),
        "bias": ((q, k, v), {"bias": torch.zeros(1, 1, 10, 10)}),
        "softcap": ((q, k, v), {"softcap": 20.0}),
        "sinks": ((q, k, v), {"sinks": torch.zeros(4)}),
        "dropout": ((q, k, v), {"dropout": 0.1}),
        "lse": ((q, k, v), {"return_lse": True}),
        "weights": ((q, k, v), {"return_weights": True}),
        "fused": ((q, k, v), {"backend": "fused"}),
        "math": ((q, k, v), {"backend": "math"}),
        "grad": ((trained, k, v), {}),
        "too-many-keys": ((long[:, :, :5], long, long), {}),
        "one-task": ((q[:1, :1], k[:1, :1], v[:1, :1]), {}),
    }


TAKEN = {"none", "padding", "padding-one-row", "padding-expanded", "key_padding"}


@pytest.mark.parametrize("case", sorted(_cases()))
def test_the_dispatcher_and_the_early_check_agree(emulated: None, case: str) -> None:
    """`short_widens_itself` (asked before any float32 copy) says yes exactly where the Plan on
    the bf16 inputs names the kernel: a call it takes is never left on emulated bf16 products,
    and one it does not take is planned in float32."""
    (q, k, v), kwargs = _cases()[case]
    mask, backend = kwargs.get("mask"), str(kwargs.get("backend", "auto"))
    scored = any(kwargs.get(name) is not None for name in ("bias", "softcap", "sinks"))
    outputs = bool(kwargs.get("return_lse") or kwargs.get("return_weights"))
    early = short_widens_itself(
        q, k, v, mask, backend, scored=scored, dropout=float(kwargs.get("dropout", 0.0)), outputs=outputs  # type: ignore[arg-type]
    )
    threads = torch.get_num_threads()
    taken = case in TAKEN or (case == "one-task" and threads == 1)
    assert early == taken
    with FakeTensorMode() as fake:  # traced: the compiled kernel is not, so the call is widened
        q_f, k_f, v_f = (fake.from_tensor(x) for x in (q, k, v))
        assert not short_widens_itself(q_f, k_f, v_f, None, backend, scored=False, dropout=0.0, outputs=False)
    said = qkv.explain(q, k, v, **kwargs)  # type: ignore[arg-type]
    assert said.forward_kernel.startswith(f"the {short_wide.KERNEL_NAME}") == taken


def test_switched_off_the_call_is_widened_and_gives_the_same_answer(emulated: None, monkeypatch: pytest.MonkeyPatch) -> None:
    lengths = torch.tensor([17, 40, 1])
    padding = qkv.masks.key_padding(lengths)  # qkv's own mask object this time
    q, k, v, _ = _problem(3, 6, 2, 25, 40, 48, 24, seed=2)
    q, k, v = (x.to(DTYPE) for x in (q, k, v))
    want = _reference(q, k, v, _valid(3, 40, lengths.tolist()), 48**-0.5)
    fast = qkv.attention(q, k, v, padding)
    spy = _spy(monkeypatch)
    with qkv.backends.disabled("short_wide"):
        widened, said = qkv.attention(q, k, v, padding), qkv.explain(q, k, v, padding)
    assert spy.calls == 0
    assert not said.forward_kernel.startswith(f"the {short_wide.KERNEL_NAME}")
    for out in (fast, widened):
        assert _within_half_an_ulp(out, want)


def test_native_bf16_without_amx_runs_it_and_explain_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where bf16 is native but there is no AMX (tier avx512 with AVX-512 BF16; forced on an AMX
    machine), the short calls stay in bf16 and take this kernel too; switched off, SDPA runs
    and explain says that this kernel, not the AMX one, does not run."""
    monkeypatch.setenv("QKV_CPU_TIER", "avx512")
    monkeypatch.delenv("QKV_KEEP_EMULATED_DTYPES", raising=False)
    monkeypatch.delenv("QKV_NO_COMPILED_KERNELS", raising=False)
    q, k, v = (x.to(DTYPE) for x in _problem(2, 4, 4, 30, 30, 32, 32, seed=8)[:3])
    said = qkv.explain(q, k, v)
    if compute_dtype(DTYPE, CPU) != DTYPE:
        pytest.skip("bf16 is emulated here (the forced tier is ignored): the emulated tier's tests above cover it")
    reason = short_wide.unavailable_reason(DTYPE, CPU)
    if reason is not None:  # no compiler: SDPA runs, and explain says why this kernel does not
        assert said.kernels[0] == "sdpa"
        assert f"(the {short_wide.KERNEL_NAME} does not run: {reason}" in said.forward_kernel
        return
    assert said.kernels == ("short_wide", "none")
    assert "the short-sequence bf16 kernel does not run: this CPU's tier is avx512" in said.forward_kernel
    spy = _spy(monkeypatch)
    out = qkv.attention(q, k, v)
    assert spy.calls == 1 and out.dtype == DTYPE
    assert _within_half_an_ulp(out, _reference(q, k, v, None, 32**-0.5))
    with qkv.backends.disabled("short_wide"):
        said = qkv.explain(q, k, v)
    assert said.kernels == ("sdpa", "sdpa")
    assert f"(the {short_wide.KERNEL_NAME} does not run: it is switched off" in said.forward_kernel


def test_no_compiled_kernels_switch(emulated: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QKV_NO_COMPILED_KERNELS", "1")
    assert short_wide.unavailable_reason(DTYPE, CPU) == "QKV_NO_COMPILED_KERNELS is set"
    q = torch.randn(2, 2, 8, 32).to(DTYPE)
    assert short_wide.forward(q, q, q, None, 1.0) is None
    assert not qkv.explain(q, q, q).forward_kernel.startswith(f"the {short_wide.KERNEL_NAME}")


def test_a_failed_build_falls_back_to_float32_copies(emulated: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The first call plans the kernel, whose build fails: it still answers (SDPA on float32
    copies, rounded once); later calls are planned in float32 and say why."""
    use_failing_compiler(monkeypatch, tmp_path)
    monkeypatch.setattr(short_wide._TIERED, "builds", {})
    q, k, v, _ = _problem(3, 2, 2, 12, 12, 32, 32, seed=4)
    q, k, v = (x.to(DTYPE) for x in (q, k, v))
    valid = _valid(3, 12, [12, 5, 0])  # the last batch row sees no key: zeros
    want = _reference(q, k, v, valid, 32**-0.5)
    first = qkv.attention(q, k, v, valid[:, None, None, :])
    assert first.dtype == DTYPE and _within_half_an_ulp(first, want)
    assert short_wide.unavailable_reason(DTYPE, CPU) == FAILED_BUILD
    said = qkv.explain(q, k, v, valid[:, None, None, :])
    assert not said.forward_kernel.startswith(f"the {short_wide.KERNEL_NAME}")
    assert _within_half_an_ulp(qkv.attention(q, k, v, valid[:, None, None, :]), want)


def test_the_kernel_builds_where_nothing_is_missing() -> None:
    # with a compiler the machine's build must build and pass its self-check (a float64
    # comparison): otherwise the dispatch tests above would quietly test the fallback
    static = compiled.tier_reason(short_wide.TIERS, DTYPE, CPU, short_wide.DTYPES)
    if static is not None:
        assert short_wide.unavailable_reason(DTYPE, CPU) == static
        return
    q = torch.randn(1, 2, 3, 32).to(DTYPE)
    out = short_wide.forward(q, q, q, torch.tensor([[True, False, False]]), 1.0)
    assert short_wide.unavailable_reason(DTYPE, CPU) is None
    assert out is not None and out.shape == (1, 2, 3, 32)
    assert torch.equal(out[0], q[0, :, :1].expand(2, 3, 32))  # every query sees key 0 only
