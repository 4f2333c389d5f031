"""The bfloat16 magnitude scan (`qkv.kernels.magnitude_bf16`): its largest |x| against torch's
own reduction in float32 (exact: every bfloat16 value is a float32), on awkward layouts and
special values; its use by the input check of `qkv.attention`; why it does not run.

Each test goes through the input check's own reduction (`qkv._problem._largest_magnitudes`,
torch.aminmax where the scan cannot run), and a spy counts the scan's results, so a test
fails if the check silently stops using it on a machine that can build it.
"""

from __future__ import annotations

import math

import pytest
import torch

import qkv
from qkv import _problem
from qkv.kernels import compiled, magnitude_bf16
from tests.kernels._spy import CallSpy

BF16 = torch.bfloat16
CPU = torch.device("cpu")


def _can_run() -> bool:
    return compiled.static_reason(BF16, CPU) is None and magnitude_bf16.ENABLED


def _want(x: torch.Tensor) -> float:
    """max |x| from torch in float32 (inf when an entry is infinite or NaN)."""
    top = float(x.float().abs().amax())
    return math.inf if math.isnan(top) else top


def _scanned(x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> float:
    """The input check's max |x|, asserting that the scan computed it where it can run."""
    _built_already()
    spy = CallSpy(monkeypatch, magnitude_bf16, "magnitude_of")
    (found,) = _problem._largest_magnitudes((x,))
    assert spy.calls == (1 if _can_run() else 0), magnitude_bf16.unavailable_reason(x)
    monkeypatch.undo()
    return found


def _built_already() -> None:
    """Build the scan (its self-check calls magnitude_of too) before a spy counts calls."""
    magnitude_bf16.largest_magnitudes([torch.zeros(1 << 20, dtype=BF16)])


def _base(seed: int = 0) -> torch.Tensor:
    """(2, 3, 797, 331) bf16: 1,582,842 values (every view below keeps MIN_VALUES), rows of 331
    (a tail of 11)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 797, 331, generator=gen).to(BF16)


# views of the base tensor: contiguous, a transposed pair of dims, sliced rows, a head dim sliced
# at both ends (rows start unaligned), and a fused projection's chunk
LAYOUTS = {
    "contiguous": lambda x: x,
    "transposed": lambda x: x.transpose(1, 2),
    "rows-sliced": lambda x: x[:, :, 1:],
    "unaligned": lambda x: x[..., 3:-5],
    "projection-chunk": lambda x: x.reshape(2, 3, 797 * 331)[:, 1:],
    "four-strided-dims": lambda x: x.permute(2, 0, 1, 3)[:, :, :, 1:],
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_largest_magnitude_is_torchs(layout: str, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    x = _base()
    view = LAYOUTS[layout](x)
    flat_index = {"first": 0, "last": view.numel() - 1, "middle": view.numel() // 2 + 7}[where]
    # the largest magnitude is negative (the sign bit must be cleared, not compared) at that spot
    index = torch.unravel_index(torch.tensor(flat_index), view.shape)
    view[tuple(int(i) for i in index)] = -77.5
    assert magnitude_bf16.strided_rows(view) is not None
    assert _scanned(view, monkeypatch) == _want(view) == 77.5


@pytest.mark.parametrize("special", [math.inf, -math.inf, math.nan, -math.nan, 3.0e38, -1.0e-40, 0.0])
def test_special_values(special: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """inf and NaN of either sign make the result inf; the largest finite bfloat16 and a
    subnormal are read exactly; a tensor of zeros (with negative zeros) gives 0."""
    if special in (-1.0e-40, 0.0):
        x = torch.zeros(1 << 20, dtype=BF16)
        x[1::2] = -0.0
    else:
        x = _base(1).flatten()
    x[12345] = special
    got = _scanned(x, monkeypatch)
    assert got == _want(x)
    if special == -1.0e-40:
        assert got == float(torch.tensor(-1.0e-40, dtype=BF16).abs()) > 0.0


def test_reasons_it_does_not_run() -> None:
    small = torch.ones(10, dtype=BF16)
    assert "at least" in magnitude_bf16.unavailable_reason(small)
    assert magnitude_bf16.largest_magnitudes([small]) == [None]
    wide = torch.ones(1 << 20)
    assert "bfloat16 only" in magnitude_bf16.unavailable_reason(wide)
    assert magnitude_bf16.strided_rows(torch.ones(4, 1 << 18, dtype=BF16)[:, ::2]) is None  # last dim strided


def test_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(magnitude_bf16, "ENABLED", False)
    assert "switched off" in magnitude_bf16.unavailable_reason(_base())
    monkeypatch.setenv("QKV_NO_COMPILED_KERNELS", "1")
    monkeypatch.setattr(magnitude_bf16, "ENABLED", True)
    assert "QKV_NO_COMPILED_KERNELS" in magnitude_bf16.unavailable_reason(_base())


def test_the_input_check_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large bf16 inputs of qkv.attention are scanned: the refusal of overflowing scores and the
    NaN rule see the same magnitudes as torch's reduction."""
    _built_already()
    spy = CallSpy(monkeypatch, magnitude_bf16, "magnitude_of")
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 4096, 128, generator=gen).to(BF16) for _ in range(3))  # 1,048,576 values each
    q[0, 1, 4095, 127] = -1.0e19
    k[0, 0, 0, 0] = 2.0e19
    with pytest.raises(ValueError, match="overflow"):
        qkv.attention(q, k, v, qkv.masks.causal())
    assert spy.calls == (3 if _can_run() else 0)
    assert _problem._largest_magnitudes((q, k, v))[:2] == [_want(q), _want(k)]
    v[0, 1, 7, 3] = math.nan
    assert _problem._check_magnitudes(q / 1e19, k / 1e19, v, None, 0.125) is True  # v non-finite: the NaN rule


def test_magnitude_of_bits() -> None:
    for value in (1.0, -2.5, 3.0e38, 1.0e-40, 65504.0):
        bits = int(torch.tensor(value, dtype=BF16).view(torch.int16)) & 0x7FFF
        assert magnitude_bf16.magnitude_of(bits) == abs(float(torch.tensor(value, dtype=BF16)))
    assert magnitude_bf16.magnitude_of(0x7F80) == math.inf
    assert magnitude_bf16.magnitude_of(0x7FFF) == math.inf  # a NaN
