"""`qkv doctor`: the CPU tier from PyTorch's queries, native dtypes, and each compiled kernel with
its reason, in text and JSON; `--build` builds what may run here and reports a failed build as a
reason. Expected values come from torch's own queries and from `compiled.static_reason`."""

from __future__ import annotations

import json

import pytest
import torch
from tests.kernels._compiler import REASON as FAILED_BUILD
from tests.kernels._compiler import forget_builds, use_failing_compiler
from typer.testing import CliRunner

from qkv.cli import app
from qkv.native import (
    add_norm_bf16,
    decode,
    interval_bf16,
    interval_bf16_backward,
    machine,
    magnitude,
    short_bf16,
    short_wide,
)
from qkv.native import build as compiled

# the bf16 kernels, which share one reason where they cannot run (`compiled.static_reason`)
KERNEL_STEMS = {"interval_bf16", "interval_bf16_backward", "short_bf16", "add_norm_bf16"}
# the fused interval pair is built for amx and, with its own micro-kernel, for avx512 with AVX-512 BF16
INTERVAL_MODULES = {"interval_bf16": interval_bf16, "interval_bf16_backward": interval_bf16_backward}
# the kernels built per tier (from AVX2 up): one entry each, the build for this tier
TIERED_MODULES = {"decode": decode, "magnitude": magnitude, "short_wide": short_wide}
TIERED = tuple(f"{stem}_" for stem in TIERED_MODULES)
CPU = torch.device("cpu")


def _decode_stem() -> str:
    """The decode kernel's entry: its build for the tier qkv uses now (float32 and bf16, AVX2 up)."""
    tier = decode.TIERS[0] if compiled.build_tier(decode.TIERS) is None else compiled.build_tier(decode.TIERS)
    if tier == "amx" and not machine.cpu_features().avx512_bf16:
        tier = "avx512"
    return f"decode_{tier}"


def _magnitude_stem() -> str:
    """The magnitude scan's entry: its build for the tier qkv uses now (AVX2 up; amx runs avx512)."""
    return f"magnitude_{compiled.build_tier(magnitude.TIERS) or magnitude.TIERS[0]}"


def _short_wide_stem() -> str:
    """The bf16 short-sequence kernel with float32 products: its build for the tier qkv uses now (AVX2 up)."""
    return f"short_wide_{compiled.build_tier(short_wide.TIERS) or short_wide.TIERS[0]}"


def _tiered_reason(stem: str) -> str | None:
    if stem.startswith("short_wide_"):
        return short_wide.unavailable_reason(torch.bfloat16, CPU)  # it runs bf16 only
    cpu_reason = decode.unavailable_reason if stem.startswith("decode_") else magnitude.kernel_reason
    return cpu_reason(torch.float32, CPU)


@pytest.fixture(autouse=True)
def _fresh_probe() -> object:
    machine._FEATURES.clear()
    yield
    machine._FEATURES.clear()


def _bf16_stem(stem: str) -> str:
    """The stem doctor lists for a bf16 kernel: the interval pair's avx512 build on a tier
    avx512 machine with AVX-512 BF16."""
    features = machine.cpu_features()
    avx512_build = stem in INTERVAL_MODULES and features.tier == "avx512" and features.avx512_bf16
    return f"{stem}_avx512" if avx512_build else stem


def _bf16_static_reason(stem: str) -> str | None:
    """Why a bf16 kernel (``stem`` as doctor lists it) cannot run here, from facts that need no build."""
    base = stem.removesuffix("_avx512")
    if base in INTERVAL_MODULES:
        return compiled.interval_reason(torch.bfloat16, CPU)
    return compiled.static_reason(torch.bfloat16, CPU)


def _report(*args: str, exit_code: int = 0) -> dict:  # type: ignore[type-arg]
    result = CliRunner().invoke(app, ["doctor", "--json", *args])
    assert result.exit_code == exit_code, result.output
    return json.loads(result.stdout)


def test_json_names_the_tier_and_every_kernel() -> None:
    report = _report()
    assert report["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert report["tier"] == machine.cpu_features().tier
    # torch's own queries, within the tier qkv uses (QKV_CPU_TIER=avx2 on this machine: emulated)
    machine_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    within_tier = machine.TIERS.index(report["tier"]) >= machine.TIERS.index("avx512")
    assert report["native"]["bfloat16"] == (machine_bf16 and within_tier)
    assert report["torch"] == torch.__version__
    bf16_stems = {_bf16_stem(stem) for stem in KERNEL_STEMS}
    assert {k["stem"] for k in report["kernels"]} == bf16_stems | {_decode_stem(), _magnitude_stem(), _short_wide_stem()}
    for kernel in report["kernels"]:
        assert kernel["available"] == (kernel["reason"] is None)
        if kernel["stem"].startswith(TIERED):
            assert kernel["reason"] == _tiered_reason(kernel["stem"])
        elif (static := _bf16_static_reason(kernel["stem"])) is not None:  # the machine's reason
            assert kernel["reason"] == static and not kernel["available"]


def test_a_forced_tier_turns_the_kernels_off_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QKV_NO_COMPILED_KERNELS", raising=False)
    monkeypatch.setenv("QKV_CPU_TIER", "avx2")
    report = _report()
    assert report["tier"] == "avx2" and not report["native"]["bfloat16"]
    bf16_kernels = [k for k in report["kernels"] if not k["stem"].startswith(TIERED)]
    assert len(bf16_kernels) == len(KERNEL_STEMS)
    assert all(not k["available"] and "tier is avx2" in k["reason"] for k in bf16_kernels)
    # the decode kernel, the magnitude scan and short_wide have AVX2 builds: they stay, as on an AVX2 machine
    tiered = [k for k in report["kernels"] if k["stem"].startswith(TIERED)]
    assert [k["stem"] for k in tiered] == ["decode_avx2", "magnitude_avx2", "short_wide_avx2"]
    assert all(k["reason"] == _tiered_reason(k["stem"]) for k in tiered)
    monkeypatch.setenv("QKV_NO_COMPILED_KERNELS", "1")
    assert all(k["reason"] == "QKV_NO_COMPILED_KERNELS is set" for k in _report()["kernels"])


def test_text_output_is_one_line_per_fact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QKV_CPU_TIER", "default")
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert any(line.startswith("tier: default") for line in lines)
    assert "bfloat16: not native: qkv computes its products in float32" in lines
    kernel_lines = [line for line in lines if line.startswith("- ")]
    # the bf16 kernels and the kernels built per tier, whose lowest builds need AVX2
    assert len(kernel_lines) == len(KERNEL_STEMS) + len(TIERED) and all("does not run here" in line for line in kernel_lines)


def test_build_reports_a_failed_build_as_a_reason(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # as on a machine that could run every kernel, with a compiler that fails: no traceback,
    # each kernel's reason is its build's first error line, and how long the attempt took
    use_failing_compiler(monkeypatch, tmp_path)
    monkeypatch.delenv("QKV_NO_COMPILED_KERNELS", raising=False)  # the kernels built per tier read it themselves
    monkeypatch.setattr(compiled, "static_reason", lambda *args, **kwargs: None)

    def forget_all() -> None:
        for module in (interval_bf16, interval_bf16_backward, short_bf16, add_norm_bf16):
            forget_builds(monkeypatch, module)  # each kernel's one build attempt, emptied for this test
        for tiered in TIERED_MODULES.values():
            monkeypatch.setattr(tiered._TIERED, "builds", {})  # the kernels built per tier keep one attempt per tier

    forget_all()
    report = _report("--build", exit_code=1)  # a failed build fails the command, after its report
    assert len(report["kernels"]) == len(KERNEL_STEMS) + len(TIERED)
    for kernel in report["kernels"]:
        assert kernel["reason"] == FAILED_BUILD
        assert kernel["seconds"] is not None and not kernel["built"]
        assert kernel["folder"].startswith(str(tmp_path / "cache"))
    forget_all()  # as a new process would: one attempt per kernel
    result = CliRunner().invoke(app, ["doctor", "--build"])  # the text report ends with the count
    count = len(KERNEL_STEMS) + len(TIERED)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stdout.splitlines()[-1].startswith(f"{count} of {count} builds failed (each line above says why)")


def test_build_builds_every_kernel_and_says_how_long(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # a cold cache: every kernel that may run here is compiled (side by side), loaded and
    # self-checked, and its line says how long that took; elsewhere each line says why not
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    for module in (interval_bf16, interval_bf16_backward, short_bf16, add_norm_bf16):
        forget_builds(monkeypatch, module)
    for tiered in TIERED_MODULES.values():
        monkeypatch.setattr(tiered._TIERED, "builds", {})
    result = CliRunner().invoke(app, ["doctor", "--build"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith("- ")]
    assert len(lines) == len(KERNEL_STEMS) + len(TIERED)
    bf16_names = {m.KERNEL_NAME: m.__name__.rsplit(".", 1)[1] for m in (interval_bf16, interval_bf16_backward, short_bf16, add_norm_bf16)}
    for line in lines:
        stem = next((s for s, m in TIERED_MODULES.items() if line.startswith(f"- {m.KERNEL_NAME} (")), None)
        if stem is not None:
            reason = _tiered_reason(f"{stem}_")
            expected = ": runs here, built in " if reason is None else f"does not run here: {reason}"
            assert expected in line and (reason is not None or f", {tmp_path}/qkv_{stem}_" in line), line
            continue
        name = line.removeprefix("- ").split(":")[0]
        bf16_stem = _bf16_stem(bf16_names[name.removesuffix(" (avx512 build)")])
        assert name.endswith(" (avx512 build)") == bf16_stem.endswith("_avx512"), line
        static = _bf16_static_reason(bf16_stem)
        if static is None:
            assert ": runs here, built in " in line and f", {tmp_path}/qkv_" in line, line
        else:
            assert line.endswith(f"does not run here: {static}")
