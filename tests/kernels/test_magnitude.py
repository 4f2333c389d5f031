"""The magnitude scan (`qkv.native.magnitude`): its largest |x| of float32, bfloat16 and float16
tensors against torch's own reduction in float32 (exact: every such value is a float32), on
awkward layouts and special values, in the machine's build and the AVX2 build; its fused
bfloat16 widening against torch's conversion; its use by the input check of `qkv.attention`;
why it does not run.

Each test of the input check goes through its own reduction
(`qkv.attention.problem._largest_magnitudes`, torch.aminmax where the scan cannot run), and a
spy counts the scan's results, so a test fails if the check silently stops using it on a
machine that can build it.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

import qkv
from qkv.attention import problem as _problem
from qkv.native import build as compiled
from qkv.native import machine, magnitude, switches
from tests.kernels._spy import CallSpy

BF16 = torch.bfloat16
CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _can_run(dtype: torch.dtype = BF16, tier: str | None = None) -> bool:
    return magnitude.kernel_reason(dtype, CPU, tier) is None and not switches.is_off("magnitude")


def _above_this_machine(tier: str | None) -> bool:
    """Whether ``tier`` names a build this machine cannot run (QKV_CPU_TIER=default): asked
    for, it is refused with a ValueError."""
    if tier is None or compiled.build_tier((tier,)) is not None:
        return False
    with pytest.raises(ValueError, match="above this machine's tier"):
        magnitude.largest_magnitudes([torch.ones(3)], tier=tier)
    return True


def _avx2_runs() -> bool:
    """Whether the AVX2 build runs here (a tier of AVX2 or above, a compiler, not switched off)."""
    return compiled.build_tier(("avx2",)) is not None and _can_run(torch.float32, "avx2")


def _want(x: torch.Tensor) -> float:
    """max |x| from torch in float32 (inf when an entry is infinite or NaN)."""
    top = float(x.float().abs().amax())
    return math.inf if math.isnan(top) else top


def _scanned(x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> float:
    """The input check's max |x|, asserting that the scan computed it where it can run."""
    _built_already()
    spy = CallSpy(monkeypatch, magnitude, "magnitude_of")
    (found,) = _problem._largest_magnitudes((x,))
    assert spy.calls == (1 if _can_run(x.dtype) else 0), magnitude.unavailable_reason(x)
    monkeypatch.undo()
    return found


def _built_already() -> None:
    """Build the scan (its self-check calls magnitude_of too) before a spy counts calls."""
    magnitude.largest_magnitudes([torch.zeros(1 << 20, dtype=BF16)])


def _base(seed: int = 0, dtype: torch.dtype = BF16) -> torch.Tensor:
    """(2, 3, 797, 331): 1,582,842 values (every view below keeps MIN_VALUES), rows of 331
    (a tail past the last whole vector in every tier and dtype)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 797, 331, generator=gen).to(dtype)


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


def _marked(layout: str, where: str, dtype: torch.dtype) -> torch.Tensor:
    """A view whose largest magnitude, -77.5, is negative (the sign bit must be cleared, not
    compared) and at one spot: first, last or in the middle."""
    view = LAYOUTS[layout](_base(0, dtype))
    flat_index = {"first": 0, "last": view.numel() - 1, "middle": view.numel() // 2 + 7}[where]
    index = torch.unravel_index(torch.tensor(flat_index), view.shape)
    view[tuple(int(i) for i in index)] = -77.5
    return view


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_largest_magnitude_is_torchs(dtype: torch.dtype, layout: str, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    view = _marked(layout, where, dtype)
    assert magnitude.strided_rows(view) is not None
    assert _scanned(view, monkeypatch) == _want(view) == 77.5


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_the_avx2_build_agrees(dtype: torch.dtype) -> None:
    """The AVX2 build (what an AMD EPYC runs), forced on this machine: every layout, the mark
    in each place, all of them in one call (the threads split the shares of all of them)."""
    views = [_marked(layout, where, dtype) for layout in LAYOUTS for where in ("first", "last")]
    assert [_want(v) for v in views] == [77.5] * len(views)
    if compiled.build_tier(("avx2",)) is None:  # below AVX2 (QKV_CPU_TIER=default): no such build
        with pytest.raises(ValueError, match="above this machine's tier"):
            magnitude.largest_magnitudes(views, tier="avx2")
        return
    want = [77.5] * len(views) if _avx2_runs() else [None] * len(views)
    assert magnitude.largest_magnitudes(views, tier="avx2") == want


def test_a_forced_tier_runs_the_avx2_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QKV_CPU_TIER", "avx2")
    machine._FEATURES.clear()
    try:
        assert magnitude._TIERED.machine_build().stem == "magnitude_avx2"
        x = _marked("transposed", "middle", torch.float32)
        assert magnitude.largest_magnitudes([x]) == ([77.5] if _avx2_runs() else [None])
        if _avx2_runs():
            assert isinstance(magnitude._TIERED.builds["avx2"]["module"], ctypes.CDLL)
    finally:
        monkeypatch.undo()
        machine._FEATURES.clear()


def test_tier_must_be_a_build() -> None:
    with pytest.raises(ValueError, match="built for avx2, avx512"):
        magnitude.largest_magnitudes([torch.ones(3)], tier="amx")


def _specials(dtype: torch.dtype) -> list[float]:
    info = torch.finfo(dtype)
    subnormal = info.smallest_normal / 4  # below the normal range: a denormal of every dtype here
    return [math.inf, -math.inf, math.nan, -math.nan, info.max, -info.max, -subnormal, 0.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
@pytest.mark.parametrize("tier", [None, "avx2"])
def test_special_values(dtype: torch.dtype, tier: str | None) -> None:
    """inf and NaN of either sign make the result inf; the largest finite value and a
    denormal are read exactly; a tensor of zeros (with negative zeros) gives 0. Where the scan
    cannot run it takes none of them, and the input check's fallback gives the same answers."""
    tensors = []
    for special in _specials(dtype):
        if abs(special) < 1.0:  # zeros and a denormal: nothing larger around it
            x = torch.zeros(1 << 20, dtype=dtype)
            x[1::2] = -0.0
        else:
            x = _base(1, dtype).flatten()
        x[12345] = special
        tensors.append(x)
    want = [_want(x) for x in tensors]
    info = torch.finfo(dtype)
    assert want[:4] == [math.inf] * 4 and want[4:6] == [info.max] * 2 and want[7] == 0.0
    assert want[6] == float(torch.tensor(info.smallest_normal / 4, dtype=dtype)) > 0.0
    if _above_this_machine(tier):
        return
    got = magnitude.largest_magnitudes(tensors, tier=tier)
    assert got == (want if _can_run(dtype, tier) else [None] * len(tensors))
    assert _problem._largest_magnitudes(tuple(tensors)) == want


def test_reasons_it_does_not_run() -> None:
    small = torch.ones(10, dtype=BF16)
    assert "at least" in (magnitude.unavailable_reason(small) or "")
    assert magnitude.largest_magnitudes([small]) == [None]
    double = torch.ones(1 << 20, dtype=torch.float64)
    assert "float32 and bfloat16 and float16 only" in (magnitude.unavailable_reason(double) or "")
    assert magnitude.largest_magnitudes([double]) == [None]
    assert magnitude.strided_rows(torch.ones(4, 1 << 18, dtype=BF16)[:, ::2]) is None  # last dim strided


def test_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    with qkv.backends.disabled("magnitude"):
        assert magnitude.unavailable_reason(_base()) == 'it is switched off (qkv.backends.disabled("magnitude"))'
        assert magnitude.largest_magnitudes([_base(), _base(0, torch.float32)]) == [None, None]
    monkeypatch.setenv("QKV_NO_COMPILED_KERNELS", "1")
    assert magnitude.largest_magnitudes([_base()]) == [None]
    assert magnitude.unavailable_reason(_base()) == "QKV_NO_COMPILED_KERNELS is set"


def test_the_input_check_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large inputs of qkv.attention are scanned, q, k and v in one call: the refusal of
    overflowing scores and the NaN rule see the same magnitudes as torch's reduction."""
    _built_already()
    spy = CallSpy(monkeypatch, magnitude, "magnitude_of")
    gen = torch.Generator().manual_seed(2)
    for dtype, big in ((BF16, 1.0e19), (torch.float32, 1.0e19), (torch.float16, 300.0)):
        q, k, v = (torch.randn(1, 2, 4096, 128, generator=gen).to(dtype) for _ in range(3))  # 1,048,576 values each
        q[0, 1, 4095, 127] = -big
        k[0, 0, 0, 0] = 2 * big
        if dtype != torch.float16:  # float16 accumulates in float32: nothing this large overflows
            with pytest.raises(ValueError, match="overflow"):
                qkv.attention(q, k, v, qkv.masks.causal())
        before = spy.calls
        assert _problem._largest_magnitudes((q, k, v))[:2] == [_want(q), _want(k)]
        assert spy.calls - before == (3 if _can_run(dtype) else 0)
        v[0, 1, 7, 3] = math.nan
        assert _problem._check_magnitudes(q / big, k / big, v, None, 0.125) is True  # v non-finite: the NaN rule


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_magnitude_of_bits(dtype: torch.dtype) -> None:
    bits_of = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    mask = 0x7FFFFFFF if dtype == torch.float32 else 0x7FFF
    for value in (1.0, -2.5, torch.finfo(dtype).max, -torch.finfo(dtype).smallest_normal / 8, 65504.0):
        x = torch.tensor(value, dtype=dtype)
        assert magnitude.magnitude_of(int(x.view(bits_of)) & mask, dtype) == abs(float(x))
    for special in (math.inf, math.nan):
        assert magnitude.magnitude_of(int(torch.tensor(special, dtype=dtype).view(bits_of)) & mask, dtype) == math.inf


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
        layout = magnitude.strided_rows(x)
        assert layout is not None, (tuple(x.shape), x.stride())
        sizes, strides, inner = layout
        starts = [0]
        for n, s in zip(sizes, strides, strict=True):
            starts = [a + i * s for a in starts for i in range(n)]
        offsets = [a + j for a in starts for j in range(inner)]
        assert offsets == (x.flatten() - x.storage_offset()).tolist(), (tuple(x.shape), x.stride())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tier", [None, "avx2"])
def test_widening_copies_exactly_and_scans(tier: str | None, stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """widen_bf16 writes torch's own float32 conversion of each bfloat16 tensor (strided ones
    in row-major order) and its largest magnitude; specials included. ``stream``: in
    non-temporal stores (`magnitude.STREAM_BYTES`), into outputs that start off a 64-byte
    boundary too."""
    monkeypatch.setattr(magnitude, "STREAM_BYTES", 0 if stream else 1 << 62)
    q = _marked("transposed", "last", BF16)
    k = _base(7).flatten()
    k[5] = -math.inf
    v = _base(8)[..., 1:]
    v[0, 0, 0, 0] = math.nan
    out = [torch.full(t.shape, 3.0) for t in (q, k, v)]
    out[1] = torch.full((k.numel() + 3,), 3.0)[3:]  # 12 bytes past an aligned start
    if _above_this_machine(tier):
        return
    found = magnitude.widen_bf16([q, k, v], out, tier=tier)
    if not _can_run(BF16, tier):
        assert found is None and all(bool((o == 3.0).all()) for o in out)  # nothing written
        return
    assert found == [77.5, math.inf, math.inf]
    for t, o in zip((q, k, v), out, strict=True):
        assert torch.equal(o.isnan(), t.isnan()) and torch.equal(o.nan_to_num(), t.float().nan_to_num())
    with pytest.raises(ValueError, match="contiguous float32"):
        magnitude.widen_bf16([q], [torch.empty(q.shape, dtype=BF16)], tier=tier)
    small = torch.ones(10, dtype=BF16)
    assert magnitude.widen_bf16([small], [torch.zeros(10)]) is None  # too small to be taken


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
    assert magnitude.largest_magnitudes([k]) == [None]
    if _can_run(BF16):
        assert "not in memory" in (magnitude.unavailable_reason(k) or "")


def test_a_failed_build_leaves_the_check_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    tier = magnitude._TIERED.machine_build().tier
    assert tier is not None
    monkeypatch.setattr(magnitude._TIERED, "builds", {tier: {"module": "its build failed (no compiler)"}})
    x = _base(5, torch.float32)
    x[1, 2, 3, 4] = -9.0
    assert magnitude.largest_magnitudes([x]) == [None]
    if compiled.tier_reason(magnitude.TIERS, torch.float32, CPU, magnitude.DTYPES) is None:  # elsewhere the machine's own reason comes first
        assert "no compiler" in (magnitude.unavailable_reason(x) or "")
    assert _problem._largest_magnitudes((x,)) == [_want(x)] == [9.0]


def test_the_self_check_catches_a_wrong_scan() -> None:
    """A scan that gives wrong magnitudes (here: the field of 1.0 for every tensor) is refused at
    load, so the input check keeps torch's reduction."""

    def always_one(tensors: list[torch.Tensor], out: object = None) -> torch.Tensor:
        return torch.full((len(tensors),), 0x3F800000, dtype=torch.int32)  # float32 1.0

    assert "self-check failed" in (magnitude._self_check(always_one) or "")


def test_tensor_subclasses_go_to_torch() -> None:
    class Tagged(torch.Tensor):
        """A tensor subclass whose values are plain floats: the scan still leaves it to torch."""

    x = _base(6).as_subclass(Tagged)
    assert "plain tensors" in (magnitude.unavailable_reason(x) or "")


def test_a_mask_that_does_not_fit_is_refused_before_the_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Size errors come before the data checks: a wrong mask on a large input neither scans it
    nor builds the scan on a fresh machine."""
    spy = CallSpy(monkeypatch, magnitude, "largest_magnitudes")
    q = torch.zeros(1, 2, 4096, 128, dtype=BF16)
    with pytest.raises(ValueError, match="batch size 3"):
        qkv.attention(q, q, q, qkv.masks.key_padding(torch.ones(3, 4096, dtype=torch.bool)))
    assert spy.calls == 0
    qkv.attention(q[:, :, :8], q, q, qkv.masks.key_padding(torch.ones(1, 4096, dtype=torch.bool)))
    assert spy.calls == 1  # the spy sees the check when the mask fits
