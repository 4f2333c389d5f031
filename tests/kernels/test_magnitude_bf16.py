"""The bfloat16 magnitude scan (`qkv.native.magnitude_bf16`): its largest |x| against torch's
own reduction in float32 (exact: every bfloat16 value is a float32), on awkward layouts and
special values; its use by the input check of `qkv.attention`; why it does not run.

Each test goes through the input check's own reduction (`qkv.attention.problem._largest_magnitudes`,
torch.aminmax where the scan cannot run), and a spy counts the scan's results, so a test
fails if the check silently stops using it on a machine that can build it.
"""

from __future__ import annotations

import math

import pytest
import torch

import qkv
from qkv.attention import problem as _problem
from qkv.native import build as compiled
from qkv.native import magnitude_bf16, switches
from tests.kernels._spy import CallSpy

BF16 = torch.bfloat16
CPU = torch.device("cpu")


def _can_run() -> bool:
    return compiled.static_reason(BF16, CPU) is None and not switches.is_off("magnitude_bf16")


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
    with qkv.backends.disabled("magnitude_bf16"):
        assert magnitude_bf16.unavailable_reason(_base()) == 'it is switched off (qkv.backends.disabled("magnitude_bf16"))'
        assert magnitude_bf16.largest_magnitudes([_base()]) == [None]
    monkeypatch.setenv("QKV_NO_COMPILED_KERNELS", "1")
    assert magnitude_bf16.largest_magnitudes([_base()]) == [None]
    # the reason names the variable where nothing else stops the kernels (AVX-512, AMX, tools)
    monkeypatch.delenv("QKV_NO_COMPILED_KERNELS")
    if compiled.static_reason(BF16, CPU) is None:
        monkeypatch.setenv("QKV_NO_COMPILED_KERNELS", "1")
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


def _views(gen: torch.Generator) -> torch.Tensor:
    """A random strided view of torch.arange (each value is its own offset in the storage):
    1-4 dims of 1-5 values, the last of stride 1 and at least 2 values, the others of any
    stride from 0 to 12 (so some dims step over the ones inside them exactly, some overlap)."""
    dims = int(torch.randint(1, 5, (1,), generator=gen))
    sizes = [int(n) for n in torch.randint(1, 6, (dims,), generator=gen)]
    sizes[-1] = max(sizes[-1], 2)
    strides = [int(t) for t in torch.randint(0, 13, (dims,), generator=gen)]
    strides[-1] = 1
    for d in range(dims - 2, -1, -1):  # half the dims step exactly over the one inside them
        if bool(torch.rand(1, generator=gen) < 0.5):
            strides[d] = sizes[d + 1] * strides[d + 1]
    offset = int(torch.randint(0, 3, (1,), generator=gen))
    extent = offset + sum((n - 1) * t for n, t in zip(sizes, strides, strict=True)) + 1
    return torch.arange(extent).as_strided(sizes, strides, offset)


def test_rows_lay_out_every_value_in_order() -> None:
    """strided_rows of random views names exactly the view's values, in row-major order."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(500):
        x = _views(gen)
        layout = magnitude_bf16.strided_rows(x)
        assert layout is not None, (tuple(x.shape), x.stride())
        sizes, strides, inner = layout
        starts = [0]
        for n, s in zip(sizes, strides, strict=True):
            starts = [a + i * s for a in starts for i in range(n)]
        offsets = [a + j for a in starts for j in range(inner)]
        assert offsets == (x.flatten() - x.storage_offset()).tolist(), (tuple(x.shape), x.stride())


def test_unreadable_tensors_go_to_torch() -> None:
    """Tensors without memory behind their values are never scanned (the scan would read
    through a null pointer): a functionalize wrapper gives the attention torch's answer; a
    storage freed to 0 bytes, FSDP-style, is refused by the scan."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 4096, 128, generator=gen).to(BF16) for _ in range(3))  # 1,048,576 values each
    want = qkv.attention(q[:, :, :8], k, v)
    got = torch.func.functionalize(lambda q, k, v: qkv.attention(q[:, :, :8], k, v))(q, k, v)
    assert torch.equal(got, want)
    k.untyped_storage().resize_(0)
    assert magnitude_bf16.largest_magnitudes([k]) == [None]
    if compiled.static_reason(BF16, CPU) is None:
        assert "not in memory" in magnitude_bf16.unavailable_reason(k)


def test_a_failed_build_leaves_the_check_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(magnitude_bf16, "_built", {"module": "its build failed (no compiler)"})
    x = _base(5)
    x[1, 2, 3, 4] = -9.0
    assert magnitude_bf16.largest_magnitudes([x]) == [None]
    if compiled.static_reason(BF16, CPU) is None:  # elsewhere the machine's own reason comes first
        assert "no compiler" in (magnitude_bf16.unavailable_reason(x) or "")
    assert _problem._largest_magnitudes((x,)) == [_want(x)] == [9.0]


def test_the_self_check_catches_a_wrong_scan() -> None:
    """A scan that gives wrong magnitudes (here: 1.0 for every tensor) is refused at
    load, so the input check keeps torch's reduction."""

    def always_one(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.full((len(tensors),), 0x3F80, dtype=torch.int32)  # 1.0

    assert "self-check failed" in (magnitude_bf16._self_check(always_one) or "")


def test_tensor_subclasses_go_to_torch() -> None:
    class Tagged(torch.Tensor):
        pass

    x = _base(6).as_subclass(Tagged)
    assert "plain tensors" in (magnitude_bf16.unavailable_reason(x) or "")


def test_a_mask_that_does_not_fit_is_refused_before_the_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Size errors come before the data checks: a wrong mask on a large bf16 input neither
    scans it nor builds the scan on a fresh machine."""
    spy = CallSpy(monkeypatch, magnitude_bf16, "largest_magnitudes")
    q = torch.zeros(1, 2, 4096, 128, dtype=BF16)
    with pytest.raises(ValueError, match="batch size 3"):
        qkv.attention(q, q, q, qkv.masks.key_padding(torch.ones(3, 4096, dtype=torch.bool)))
    assert spy.calls == 0
    qkv.attention(q[:, :, :8], q, q, qkv.masks.key_padding(torch.ones(1, 4096, dtype=torch.bool)))
    assert spy.calls == 1  # the spy sees the check when the mask fits
