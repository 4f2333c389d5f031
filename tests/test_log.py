"""The `qkv` logger: notes said once per cause (a first-time kernel build, a kernel that fell
back, a dtype this CPU emulates), silent unless the program asks, printed by the CLI."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import qkv
from qkv import _log
from qkv.native import build as compiled
from qkv.native.machine import emulation_note


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """No cause noted yet in this process, and every qkv record at INFO or above captured."""
    monkeypatch.setattr(_log, "_noted", set())
    caplog.set_level(logging.INFO, logger="qkv")
    return caplog


def _ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "qkv"]


def test_a_cause_is_noted_once_and_each_cause_once(fresh: pytest.LogCaptureFixture) -> None:
    asked = []

    def machine_fact() -> str:
        asked.append(1)
        return "a fact about this machine"

    for _ in range(3):
        _log.note_once("first", "said once")
        _log.note_once("second", machine_fact, logging.WARNING)
    assert [(r.levelname, r.getMessage()) for r in _ours(fresh)] == [
        ("INFO", "said once"), ("WARNING", "a fact about this machine"),
    ]
    assert asked == [1]  # the message function is not asked again either


def test_a_cause_with_nothing_to_say_is_not_asked_again(fresh: pytest.LogCaptureFixture) -> None:
    asked = []
    for _ in range(3):
        _log.note_once("native here", lambda: asked.append(1))  # returns None: nothing to say
    assert asked == [1] and _ours(fresh) == []


def test_the_library_is_silent_unless_the_program_configures_logging() -> None:
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("qkv").handlers)


def test_an_emulated_dtype_is_noted_once_whatever_the_number_of_calls(fresh: pytest.LogCaptureFixture) -> None:
    """On a CPU without bf16 instructions (no AMX, no avx512_bf16) one warning; on one with
    them, none. Either way never one per call."""
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    for _ in range(4):
        qkv.attention(q, q, q)
    qkv.attention(q.float(), q.float(), q.float())
    expected = emulation_note(torch.bfloat16, torch.device("cpu"))
    records = [(r.levelname, r.getMessage()) for r in _ours(fresh)]
    # computed in float32 (qkv.native.machine.compute_dtype): said as information, not a warning
    assert records == ([] if expected is None else [("INFO", expected)])


def test_multihead_attention_widening_a_layer_notes_it_once(
    fresh: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 layer on a tier that emulates bf16 runs in float32 from its first product
    (`MultiHeadAttention._emulated`): one note, as for `qkv.attention`."""
    monkeypatch.setenv("QKV_CPU_TIER", "avx2")
    layer = qkv.MultiHeadAttention(32, 4).to(torch.bfloat16)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    for _ in range(3):
        layer(x)
    expected = emulation_note(torch.bfloat16, torch.device("cpu"))
    assert expected is not None and "computes in float32" in expected
    assert [(r.levelname, r.getMessage()) for r in _ours(fresh)] == [("INFO", expected)]


def test_a_first_note_met_while_compiling_does_not_break_the_graph(
    fresh: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamo cannot trace the lock of a first note: under torch.compile(fullgraph=True) a note
    not yet said is left to an eager call, and the compiled call still answers."""
    monkeypatch.setenv("QKV_CPU_TIER", "avx2")  # the widened bf16 call notes it, whatever this machine is
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    compiled = torch.compile(lambda x: qkv.attention(x, x, x, backend="math"), fullgraph=True, backend="eager")
    out = compiled(q)
    want = qkv.attention(q.double(), q.double(), q.double(), backend="math")
    assert out.dtype == torch.bfloat16 and bool(((out.double() - want).abs() <= 2**-8 * want.abs() + 1e-6).all())
    assert _ours(fresh) == []  # nothing said while compiling; the first eager call says it
    qkv.attention(q, q, q)
    assert len(_ours(fresh)) == 1


def test_an_emulated_dtype_kept_as_it_is_is_a_warning(
    fresh: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QKV_CPU_TIER", "avx2")  # bf16 emulated, whatever this machine is
    monkeypatch.setenv("QKV_KEEP_EMULATED_DTYPES", "1")
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    for _ in range(3):  # causal: SDPA in bf16 (without a mask, short_wide would compute in float32 itself)
        qkv.attention(q, q, q, qkv.masks.causal())
    expected = emulation_note(torch.bfloat16, torch.device("cpu"))
    assert expected is not None and "PyTorch emulates them" in expected
    assert [(r.levelname, r.getMessage()) for r in _ours(fresh)] == [("WARNING", expected)]


def test_a_kernel_build_and_its_failure_are_noted_once(
    fresh: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A source that does not compile: the first build notes that it compiles and that qkv
    falls back; building it again (another thread, a second engine) notes nothing more."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++;\n", encoding="utf-8")
    broken = compiled.NativeKernel("broken", source, "test kernel")
    outcomes = [compiled.build(broken, check=lambda library: None) for _ in range(2)]
    assert all(isinstance(o, str) and o.startswith("its build failed") for o in outcomes)
    messages = [r.getMessage() for r in _ours(fresh)]
    assert len(messages) == 2, messages
    assert messages[0] == f"building broken (the test kernel) into {broken.folder()} ..."
    assert broken.folder().parent == tmp_path / "extensions"
    assert messages[1] == f"the test kernel is not used, qkv runs its portable path: {outcomes[0]}"


@pytest.mark.parametrize("tier", ["this machine's", "avx2"])
def test_the_cli_prints_the_notes_on_stderr_one_line_each(monkeypatch: pytest.MonkeyPatch, tier: str) -> None:
    """The encoder runs its blocks in float32 where bf16 is emulated, without a bf16 call to
    `qkv.attention`: it says so itself (forced to the avx2 tier, an AMX machine checks that too)."""
    from qkv.cli import app

    if tier == "avx2":
        monkeypatch.setenv("QKV_CPU_TIER", "avx2")
    monkeypatch.setattr(_log, "_noted", set())
    result = CliRunner().invoke(app, ["embed", "--dtype", "bfloat16", "--json", "one text", "another"])
    assert result.exit_code == 0, result.output
    expected = emulation_note(torch.bfloat16, torch.device("cpu"))
    notes = [line for line in result.stderr.splitlines() if line.startswith("qkv: ")]
    assert notes == ([] if expected is None else [f"qkv: {expected}"])
    assert result.stdout.startswith("{")  # the JSON stays alone on stdout
    if tier == "avx2":
        assert expected is not None and "computes in float32" in expected
