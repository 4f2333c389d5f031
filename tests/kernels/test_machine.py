"""`qkv.native.machine`: the CPU tier from PyTorch's own queries, the QKV_CPU_TIER switch, the
dtype qkv computes low-precision products in, and what `qkv.explain` says about the machine
(its tier, emulated dtypes, and the rates of `qkv.bench.machine_matmul_gflops` when asked)."""

from __future__ import annotations

import pytest
import torch

import qkv
import qkv.bench
from qkv.native import machine, rates

CPU = torch.device("cpu")


def _fake_machine(monkeypatch: pytest.MonkeyPatch, tier: str, avx512_bf16: bool, amx: bool) -> None:
    """Make the probe see a machine of ``tier`` (every forced tier is derived from it)."""
    capability = {"amx": "AVX512", "avx512": "AVX512", "avx2": "AVX2", "default": "DEFAULT"}[tier]
    monkeypatch.setattr(machine, "_machine", lambda: (tier, capability, avx512_bf16, amx, amx))
    machine._FEATURES.clear()
    monkeypatch.delenv(machine.TIER_VARIABLE, raising=False)
    monkeypatch.delenv(machine.KEEP_VARIABLE, raising=False)


@pytest.fixture(autouse=True)
def _fresh_probe() -> object:
    machine._FEATURES.clear()
    yield
    machine._FEATURES.clear()


def test_the_tier_agrees_with_torchs_own_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    # the probe itself, not a tier forced from outside (CI's fallback-tier run sets one)
    monkeypatch.delenv(machine.TIER_VARIABLE, raising=False)
    features = machine.cpu_features()
    capability = torch.backends.cpu.get_cpu_capability()
    assert features.capability == capability
    if torch.cpu._is_amx_tile_supported():
        assert features.detected == "amx"
    elif torch.cpu._is_avx512_supported():
        assert features.detected == "avx512"
    elif torch.cpu._is_avx2_supported():
        assert features.detected == "avx2"
    else:
        assert features.detected == "default"
    assert features.native(torch.bfloat16) == (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    assert features.native(torch.float32) and features.native(torch.float64)


@pytest.mark.parametrize(
    ("forced", "tier", "bf16_native"),
    [("", "amx", True), ("amx", "amx", True), ("avx512", "avx512", True), ("AVX2", "avx2", False), ("default", "default", False)],
)
def test_a_lower_tier_can_be_forced(monkeypatch: pytest.MonkeyPatch, forced: str, tier: str, bf16_native: bool) -> None:
    _fake_machine(monkeypatch, "amx", avx512_bf16=True, amx=True)
    monkeypatch.setenv(machine.TIER_VARIABLE, forced)
    features = machine.cpu_features()
    assert features.tier == tier and features.detected == "amx" and features.note is None
    assert features.native(torch.bfloat16) == bf16_native and features.amx == (tier == "amx")
    assert machine.compute_dtype(torch.bfloat16, CPU) == (torch.bfloat16 if bf16_native else torch.float32)
    if tier != "amx":
        assert f"forced by QKV_CPU_TIER={forced}" in features.describe()


@pytest.mark.parametrize(("forced", "says"), [("amx", "above this machine"), ("sse9", "is not a tier")])
def test_a_tier_that_cannot_be_had_is_ignored_and_said(monkeypatch: pytest.MonkeyPatch, forced: str, says: str) -> None:
    _fake_machine(monkeypatch, "avx2", avx512_bf16=False, amx=False)
    monkeypatch.setenv(machine.TIER_VARIABLE, forced)
    features = machine.cpu_features()
    assert features.tier == "avx2" and features.note is not None and says in features.note
    assert says in features.describe()


def test_avx512_without_bf16_instructions_emulates_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_machine(monkeypatch, "avx512", avx512_bf16=False, amx=False)
    assert not machine.cpu_features().native(torch.bfloat16)
    assert machine.compute_dtype(torch.bfloat16, CPU) == torch.float32
    assert machine.compute_dtype(torch.bfloat16, torch.device("meta")) == torch.bfloat16  # not a CPU
    monkeypatch.setenv(machine.KEEP_VARIABLE, "1")
    assert machine.compute_dtype(torch.bfloat16, CPU) == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_explain_says_an_emulated_dtype_is_computed_in_float32(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    q = torch.randn(1, 2, 8, 4).to(dtype)
    name = str(dtype).removeprefix("torch.")
    _fake_machine(monkeypatch, "avx2", avx512_bf16=False, amx=False)
    explained = qkv.explain(q, q, q)
    assert len(explained.notes) == 1 and "computes in float32" in explained.notes[0] and name in explained.notes[0]
    assert f"{name} computed in float32" in explained.shape
    assert f"note: {explained.notes[0]}" in str(explained) and "cpu tier: avx2" in str(explained)
    monkeypatch.setenv(machine.KEEP_VARIABLE, "1")
    kept = qkv.explain(q, q, q)
    assert "PyTorch emulates them" in kept.notes[0] and f"{name} on cpu" in kept.shape
    _fake_machine(monkeypatch, "amx", avx512_bf16=True, amx=True)
    assert qkv.explain(q, q, q).notes == () and "cpu tier: amx" in str(qkv.explain(q, q, q))


def test_an_emulated_dtype_is_computed_in_float32_and_returned_in_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # the answer of the widened call is the float32 answer rounded once: exactly that, bit for bit
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 24, generator=gen).bfloat16() for _ in range(3))
    mask = qkv.masks.sliding_window(5, 2)
    _fake_machine(monkeypatch, "avx2", avx512_bf16=False, amx=False)
    out, lse = qkv.attention(q, k, v, mask, return_lse=True)
    want, want_lse = qkv.attention(q.float(), k.float(), v.float(), mask, return_lse=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.bfloat16()) and torch.equal(lse, want_lse)
    # and independently: the float64 formula on the same bf16 inputs, within one bf16 rounding
    scores = (q.double() @ k.double().transpose(-1, -2)) * 24**-0.5  # (2, 4, 33, 33)
    scores = scores.masked_fill(~mask.to_dense(33, 33), float("-inf"))
    reference = torch.softmax(scores, dim=-1) @ v.double()  # (2, 4, 33, 24)
    torch.testing.assert_close(out.double(), reference, rtol=2**-8, atol=2**-9)
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, dim=-1), rtol=1e-6, atol=1e-5)
    trained = [x.clone().requires_grad_(True) for x in (q, k, v)]
    qkv.attention(*trained, mask).float().sum().backward()
    assert all(x.grad is not None and x.grad.dtype == torch.bfloat16 for x in trained)


def test_float32_gets_no_note() -> None:
    q = torch.randn(1, 2, 8, 4)
    assert qkv.explain(q, q, q).notes == ()


def test_machine_line_names_the_cpu_and_tier() -> None:
    line = machine.machine_line()
    assert machine.cpu_model() in line and f"tier {machine.cpu_features().describe()}" in line


def test_rates_are_measured_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_machine(monkeypatch, "amx", avx512_bf16=True, amx=True)  # bf16 kept as bf16, as the rates below say
    q = torch.randn(1, 2, 8, 4).to(torch.bfloat16)
    calls: list[torch.dtype] = []

    def fake_rate(dtype: torch.dtype, threads: int) -> float:
        calls.append(dtype)
        return {torch.float32: 400.0, torch.bfloat16: 2000.0}[dtype]

    monkeypatch.setattr(rates, "machine_matmul_gflops", fake_rate)  # explain reads it from there
    plain = qkv.explain(q, q, q)
    assert plain.matmul_rates == () and calls == [] and "machine:" not in str(plain)
    measured = qkv.explain(q, q, q, measure=True)
    assert measured.matmul_rates == (("float32", 400.0), ("bfloat16", 2000.0))
    assert calls == [torch.float32, torch.bfloat16]
    text = str(measured)
    assert "machine: matmul float32 400, bfloat16 2000 GFLOP/s" in text
    # 4 * B * H * L * S * E = 4 * 2 * 8 * 8 * 4 FLOPs at 2000 GFLOP/s
    assert f"{4 * 2 * 8 * 8 * 4 / 2000e9 * 1e3:.2f} ms at the bfloat16 matmul rate" in text


def test_linear_layers_compute_an_emulated_dtype_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    # the encoder's and MultiHeadAttention's projections (`onednn_linear.run` / `run_gelu`):
    # one float32 product rounded once, with and without a gradient
    from torch import nn
    from torch.nn import functional as F

    from qkv.native import onednn_linear

    _fake_machine(monkeypatch, "avx2", avx512_bf16=False, amx=False)
    monkeypatch.delenv("QKV_NO_COMPILED_KERNELS", raising=False)  # its reason would come first
    gen = torch.Generator().manual_seed(1)
    layer = nn.Linear(40, 24).to(torch.bfloat16)
    x = torch.randn(3, 5, 40, generator=gen).bfloat16()
    wide = F.linear(x.float(), layer.weight.float(), layer.bias.float())  # (3, 5, 24)
    with torch.no_grad():
        assert torch.equal(onednn_linear.run(layer, x), wide.bfloat16())
        assert torch.equal(onednn_linear.run_gelu(layer, x), F.gelu(wide).bfloat16())
    out = onednn_linear.run(layer, x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and layer.weight.grad is not None and layer.weight.grad.dtype == torch.bfloat16
    with torch.no_grad():
        reason = onednn_linear.unavailable_reason(x, layer.weight, layer.bias)
    assert reason is not None and reason.startswith("bfloat16 products are not native on this CPU (tier avx2)")
