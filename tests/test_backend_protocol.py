"""One backend protocol, decided once: the kernel that runs is the one the Plan names.

Each kernel's entry point is wrapped by a recorder (module attributes patched); a call then
runs forward and, where the problem needs gradients, backward, and the kernels that actually
ran are compared with ``plan.forward_kernel`` / ``plan.backward_kernel`` from `qkv.explain`.
`qkv.backends.disabled` changes the Plan's kernels and reasons, nests, and leaves the results
within the float64 reference's tolerance. Expected values come from backend="math" in float64.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import qkv
from qkv import masks as M
from qkv._private import torch as private_torch
from qkv.attention import execute as execute_module
from qkv.attention.dispatch import choose_path
from qkv.attention.problem import describe_problem
from qkv.backends import protocol
from qkv.backends.blocks import engine, scored
from qkv.native import build as compiled
from qkv.native import interval_bf16, interval_bf16_backward, short_bf16, short_wide, switches
from qkv.native.machine import compute_dtype, cpu_features

BF16 = torch.bfloat16


def _amx_kernels() -> bool:
    """Whether the compiled bf16 kernels can run here (they need AVX-512 with AMX, a compiler)."""
    return compiled.static_reason(BF16, torch.device("cpu"), needs_onednn=True) is None


def _interval_kernels() -> bool:
    """Whether the fused interval kernels can run here (AVX-512 BF16: their amx or avx512 build, a compiler)."""
    return compiled.interval_reason(BF16, torch.device("cpu")) is None


class Recorder:
    """What ran: forward and backward events of the kernels' entry points."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[str] = []
        self.all_events: list[str] = []  # every event, kept when a test clears ``events`` before a backward
        self._wrap(monkeypatch, execute_module, "fused_attention", "sdpa", hook="sdpa", dtype_of=0)
        self._wrap(monkeypatch, execute_module, "math_attention", "math", hook="math")
        self._wrap(monkeypatch, execute_module, "decode_attention", "decode", hook="decode")
        self._wrap(monkeypatch, short_bf16, "forward", "short_bf16", only_result=True)
        self._wrap(monkeypatch, short_wide, "forward", "short_wide", only_result=True)
        self._wrap(monkeypatch, interval_bf16, "forward", "interval_bf16", only_result=True)
        self._wrap(monkeypatch, engine, "run_calls", "cpu_flash_tiles")
        self._wrap(monkeypatch, scored, "_bias_tile", "bias_tile")
        self._wrap(monkeypatch, scored, "_own_forward", "own_tile")
        self._wrap(monkeypatch, interval_bf16_backward, "backward", "interval_bf16_backward", only_result=True)
        self._wrap(monkeypatch, engine, "call_gradients", "engine_products")
        self._wrap(monkeypatch, private_torch, "cpu_flash_attention_backward", "flash_backward", dtype_of=1)
        self._wrap(monkeypatch, scored, "_backward", "scored_backward")

    def _wrap(
        self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str, event: str, only_result: bool = False,
        hook: str | None = None, dtype_of: int | None = None,
    ) -> None:
        """``dtype_of``: also record the dtype of that positional argument (``event float32``)."""
        real: Callable[..., Any] = getattr(module, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            result = real(*args, **kwargs)
            if not only_result or result is not None:  # a compiled kernel returns None when it did not run
                new = [event] if dtype_of is None else [event, f"{event} {str(args[dtype_of].dtype).removeprefix('torch.')}"]
                self.events += new
                self.all_events += new
            out = result[0] if isinstance(result, tuple) else result
            if hook is not None and isinstance(out, torch.Tensor) and out.requires_grad:
                # the gradient reaches this kernel's output: autograd runs its backward next
                out.register_hook(lambda grad: self.events.append(f"{hook} backward") or None)
            return result

        monkeypatch.setattr(module, name, recorded)

    def forward_kernels(self) -> set[str]:
        """The forward kernels that ran, by the Plan's names."""
        ran = set(self.events) & {"sdpa", "math", "decode", "short_bf16", "short_wide", "interval_bf16", "cpu_flash_tiles"}
        if "sdpa" in ran and ran & {"short_bf16", "short_wide"}:
            raise AssertionError("both a short-sequence kernel and SDPA ran")
        if "own_tile" in self.events:
            ran.add("score_tiles")
        elif "bias_tile" in self.events:
            ran.add("bias_tiles")
        return ran

    def backward_kernels(self) -> set[str]:
        ran = {e.removesuffix(" backward") for e in self.events if e.endswith(" backward")}
        if "sdpa" in ran and "flash_backward" in self.events:
            # the fused path's own backward (dense.py's _FlashWithLse): on float32 copies of bf16
            # inputs when the kernel got float32 and the forward's inputs were bf16
            wide = "flash_backward float32" in self.events and "sdpa bfloat16" in self.all_events
            return (ran - {"sdpa"}) | {"sdpa_wide" if wide else "sdpa"}
        if "scored_backward" in self.events:
            ran.add("scored_per_call")
        elif "interval_bf16_backward" in self.events:
            ran.add("interval_bf16_backward")
        elif {"engine_products", "flash_backward"} & set(self.events):
            ran.add("engine_per_call")
        return ran


def _inputs(N: int, H: int, G: int, L: int, S: int, E: int, dtype: torch.dtype = torch.float32, grad: bool = True, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(N, H, L, E, generator=gen).to(dtype).requires_grad_(grad)
    k = torch.randn(N, G, S, E, generator=gen).to(dtype).requires_grad_(grad)
    v = torch.randn(N, G, S, E, generator=gen).to(dtype).requires_grad_(grad)
    return q, k, v


# name: ((N, H, G, L, S, E), mask, keyword arguments, dtype, whether inputs require grad)
CASES: dict[str, tuple[tuple[int, ...], Any, dict[str, Any], torch.dtype, bool]] = {
    "no mask": ((1, 2, 2, 64, 64, 16), None, {}, torch.float32, True),
    "causal": ((1, 2, 2, 64, 64, 16), M.causal(), {}, torch.float32, True),
    "sliding window": ((1, 2, 2, 1024, 1024, 16), M.sliding_window(64), {}, torch.float32, True),
    "documents": ((1, 2, 2, 1024, 1024, 16), M.documents(torch.arange(1024) // 128), {}, torch.float32, True),
    "alibi bias": ((1, 2, 2, 512, 512, 16), M.causal(), {"bias": "alibi"}, torch.float32, True),
    "softcap": ((1, 2, 2, 512, 512, 16), M.causal(), {"softcap": 20.0}, torch.float32, True),
    # n = 1,024: large enough that the engine beats SDPA with its portable kernels too, where the
    # fused bf16 kernels cannot run or are switched off (`qkv.backends.blocks.crossover`)
    "bf16 block engine": ((1, 2, 2, 1024, 1024, 64), M.sliding_window(64, 64), {}, BF16, True),
    "decode L=1 S=2048": ((1, 4, 2, 1, 2048, 64), None, {}, torch.float32, True),
    "short bf16": ((4, 4, 4, 64, 64, 32), None, {}, BF16, False),
    # bf16 with heads of 32 and a gradient: on an AMX machine SDPA's backward runs on float32 copies
    "bf16 fused small heads": ((1, 4, 2, 256, 256, 32), M.causal(), {}, BF16, True),
    "math": ((1, 2, 2, 64, 64, 16), M.causal(), {"backend": "math"}, torch.float32, True),
}
# the kernels each case must plan, independently of the Plan; where the compiled kernels cannot
# run (no AMX, or for the interval pair no AVX-512 BF16; QKV_NO_COMPILED_KERNELS) those of `PORTABLE`
PORTABLE = {"bf16 block engine": ("cpu_flash_tiles", "engine_per_call"), "short bf16": ("sdpa", "sdpa")}
EXPECTED = {
    "no mask": ("sdpa", "sdpa"),
    "causal": ("sdpa", "sdpa"),
    "sliding window": ("cpu_flash_tiles", "engine_per_call"),
    "documents": ("cpu_flash_tiles", "engine_per_call"),
    "alibi bias": ("bias_tiles", "scored_per_call"),
    "softcap": ("score_tiles", "scored_per_call"),
    "bf16 block engine": ("interval_bf16", "interval_bf16_backward"),
    "decode L=1 S=2048": ("decode", "decode"),
    "short bf16": ("short_bf16", "none"),
    "bf16 fused small heads": ("sdpa", "sdpa_wide"),
    "math": ("math", "math"),
}


def _case(name: str) -> tuple[tuple[torch.Tensor, ...], Any, dict[str, Any]]:
    shape, mask, kwargs, dtype, grad = CASES[name]
    kwargs = {key: qkv.bias.alibi() if value == "alibi" else value for key, value in kwargs.items()}
    return _inputs(*shape, dtype=dtype, grad=grad), mask, kwargs


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    """backend="math" in float64: the expected output."""
    wide = {key: value for key, value in kwargs.items() if key != "backend"}
    with torch.no_grad():
        return qkv.attention(q.double(), k.double(), v.double(), mask, backend="math", **wide)


def _tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == BF16 else 1e-4


@pytest.mark.parametrize("name", list(CASES))
def test_the_kernel_that_runs_is_the_one_the_plan_names(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    (q, k, v), mask, kwargs = _case(name)
    planned_forward, planned_backward = qkv.explain(q, k, v, mask, **kwargs).kernels
    compiled_kernels_run = _interval_kernels() if name == "bf16 block engine" else _amx_kernels()
    expected = EXPECTED[name] if compiled_kernels_run else PORTABLE.get(name, EXPECTED[name])
    if name == "short bf16" and not cpu_features().amx and short_wide.unavailable_reason(BF16, q.device) is None:
        expected = ("short_wide", "none")  # no AMX here: the kernel with float32 products
    if name == "bf16 fused small heads" and cpu_features().tier != "amx":
        # sdpa_wide was measured on AMX only; the interval kernels' avx512 build trains dense
        # bf16 itself; elsewhere bf16 is computed in float32 throughout, or kept
        expected = ("interval_bf16", "interval_bf16_backward") if _interval_kernels() else ("sdpa", "sdpa")
    assert (planned_forward, planned_backward) == expected
    spy = Recorder(monkeypatch)
    out = qkv.attention(q, k, v, mask, **kwargs)
    assert spy.forward_kernels() == {planned_forward}
    assert (out.double() - _reference(q, k, v, mask, kwargs)).abs().max().item() < _tolerance(q.dtype)
    if not out.requires_grad:
        return  # no backward runs
    spy.events.clear()
    out.backward(torch.ones_like(out))
    assert spy.backward_kernels() == {planned_backward}


def test_the_backward_runs_the_kernel_planned_with_its_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    (q, k, v), mask, _ = _case("bf16 block engine")
    with qkv.backends.disabled("interval_bf16_backward"):
        out = qkv.attention(q, k, v, mask)
    spy = Recorder(monkeypatch)
    out.backward(torch.ones_like(out))  # outside the block: the Plan made inside it decides
    assert spy.backward_kernels() == {"engine_per_call"}


def test_disabled_changes_the_plan_and_nesting_restores_it() -> None:
    (q, k, v), mask, _ = _case("bf16 block engine")

    def kernels() -> tuple[str, str, str | None, str | None]:
        plan = choose_path(describe_problem(q, k, v, mask, None, 0.0), "auto", False, False)
        return plan.forward_kernel, plan.backward_kernel, plan.forward_absent, plan.backward_absent

    off_forward = 'it is switched off (qkv.backends.disabled("interval_bf16"))'
    off_backward = 'it is switched off (qkv.backends.disabled("interval_bf16_backward"))'
    before = kernels()
    with qkv.backends.disabled("interval_bf16"):
        assert kernels()[0] == "cpu_flash_tiles" and kernels()[2] == off_forward
        assert kernels()[1::2] == before[1::2]  # the backward is a switch of its own
        with qkv.backends.disabled("interval_bf16_backward"):
            assert kernels() == ("cpu_flash_tiles", "engine_per_call", off_forward, off_backward)
        assert kernels()[0] == "cpu_flash_tiles" and kernels()[1::2] == before[1::2]
    assert kernels() == before
    if compute_dtype(BF16, q.device) != BF16:
        return  # qkv.explain describes the float32 problem this CPU computes instead: no kernel lines
    said = str(qkv.explain(q, k, v, mask))
    with qkv.backends.disabled("interval_bf16", "interval_bf16_backward"):
        off = str(qkv.explain(q, k, v, mask))
    assert off_forward in off and off_backward in off and off_forward not in said


@pytest.mark.parametrize(
    ("name", "switch", "forward"),
    [
        ("bf16 block engine", ("interval_bf16", "interval_bf16_backward"), "cpu_flash_tiles"),
        ("short bf16", ("short_bf16", "short_wide"), "sdpa"),
        ("decode L=1 S=2048", ("decode",), "sdpa"),
        ("sliding window", ("blocks",), "sdpa"),
    ],
)
def test_a_disabled_kernel_gives_way_and_the_result_holds(
    monkeypatch: pytest.MonkeyPatch, name: str, switch: tuple[str, ...], forward: str
) -> None:
    (q, k, v), mask, kwargs = _case(name)
    spy = Recorder(monkeypatch)
    with qkv.backends.disabled(*switch):
        planned = qkv.explain(q, k, v, mask, **kwargs).kernels[0]
        out = qkv.attention(q, k, v, mask, **kwargs)
    assert planned == forward
    assert spy.forward_kernels() == {forward}
    assert (out.double() - _reference(q, k, v, mask, kwargs)).abs().max().item() < _tolerance(q.dtype)


def test_an_explicit_backend_that_is_switched_off_is_refused() -> None:
    (q, k, v), mask, _ = _case("decode L=1 S=2048")
    with qkv.backends.disabled("decode"), pytest.raises(ValueError, match=r'backend=.decode.: it is switched off \(qkv.backends.disabled\("decode"\)\)'):
        qkv.attention(q, k, v, backend="decode")
    (q, k, v), mask, _ = _case("sliding window")
    with qkv.backends.disabled("blocks"), pytest.raises(ValueError, match=r'disabled\("blocks"\)'):
        qkv.attention(q, k, v, mask, backend="blocks")


def test_an_unknown_name_is_refused_before_anything_changes() -> None:
    with qkv.backends.disabled("short_bf16"):
        with pytest.raises(ValueError, match=r"unknown name.*'interval_bf17'.*known: interval_bf16, "):
            qkv.backends.disabled("interval_bf16", "interval_bf17").__enter__()
        assert switches.switched_off() == frozenset({"short_bf16"})
    assert switches.switched_off() == frozenset()


def test_the_switch_belongs_to_the_thread_that_set_it() -> None:
    seen: list[bool] = []
    with qkv.backends.disabled("short_bf16"):
        worker = threading.Thread(target=lambda: seen.append(switches.is_off("short_bf16")))
        worker.start()
        worker.join()
        assert switches.is_off("short_bf16")
    assert seen == [False]


def test_a_compiled_call_reads_its_own_threads_switches(plans: list[Any]) -> None:
    # another thread's open block must not reach a compiled call here, and a block opened here
    # must make the next compiled call trace again (Dynamo guards on the count of open blocks)
    (q, k, v), mask, _ = _case("sliding window")

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return qkv.attention(q, k, v, mask)

    compiled_fn = torch.compile(fn, backend="eager", fullgraph=True)
    opened, release = threading.Event(), threading.Event()

    def hold_a_block_open() -> None:
        with qkv.backends.disabled("blocks"):
            opened.set()
            release.wait(timeout=60)

    torch._dynamo.reset()
    worker = threading.Thread(target=hold_a_block_open)
    worker.start()
    try:
        assert opened.wait(timeout=60)
        out = compiled_fn(q, k, v)
        with qkv.backends.disabled("blocks"):
            switched = compiled_fn(q, k, v)
    finally:
        release.set()
        worker.join()
        torch._dynamo.reset()
    assert [plan.path for plan in plans] == ["blocks", "fused"]  # planned while Dynamo traced
    expected = _reference(q, k, v, mask, {})
    for result in (out, switched):
        assert (result.double() - expected).abs().max().item() < _tolerance(q.dtype)


def test_no_module_level_switches_remain() -> None:
    from qkv.distributed import blockwise
    from qkv.models import batches
    from qkv.native import add_norm_bf16, magnitude, onednn_linear

    for module in (interval_bf16, interval_bf16_backward, short_bf16, add_norm_bf16, magnitude, onednn_linear, batches):
        assert not hasattr(module, "ENABLED"), module.__name__
    assert not hasattr(blockwise, "USE_CPU_FLASH")


@pytest.mark.parametrize("name", ["no mask", "sliding window", "alibi bias", "decode L=1 S=2048", "bf16 block engine"])
def test_every_backend_answers_the_protocol(name: str) -> None:
    (q, k, v), mask, kwargs = _case(name)
    problem = describe_problem(q, k, v, mask, None, 0.0, **{key: val for key, val in kwargs.items() if key != "backend"})
    assert set(protocol.BACKENDS) == {"fused", "math", "blocks", "flex", "decode"}
    for key, backend in protocol.BACKENDS.items():
        assert isinstance(backend, protocol.Backend)
        assert backend.name == key
        reason = backend.unavailable_reason(problem)
        assert reason is None or (isinstance(reason, str) and reason)
        memory = backend.extra_memory(problem)
        assert isinstance(memory, int) and memory >= 0
        words = backend.describe(problem)
        assert isinstance(words, str) and (reason is None or reason in words)
        assert callable(backend.forward)
    # what each backend says of a problem, against the problem's facts
    decode_reason = protocol.BACKENDS["decode"].unavailable_reason(problem)
    if name == "decode L=1 S=2048":
        assert decode_reason is None
    else:  # 64 queries and more: the decode kernel takes at most 16
        assert decode_reason == f"it takes at most 16 queries, got L={problem.L}"
    assert protocol.BACKENDS["blocks"].unavailable_reason(problem) is None  # every case is on CPU with no tensor mask
    with qkv.backends.disabled("blocks", "decode"):
        assert "switched off" in protocol.BACKENDS["blocks"].describe(problem)
        assert "switched off" in protocol.BACKENDS["decode"].describe(problem)


def test_every_planned_kernel_has_words() -> None:
    for name in protocol.FORWARD_KERNELS:
        assert protocol.kernel_words(name)
    for name in protocol.BACKWARD_KERNELS:
        assert protocol.kernel_words(name)
    assert "does not run: because" in protocol.kernel_words("sdpa", "because")


def test_the_block_backends_entry_computes_attention() -> None:
    # the protocol's forward of "blocks" runs the engine (plain and with a bias) on a plan's tiles
    from qkv.attention.dispatch import choose_path
    from qkv.attention.problem import describe_problem
    from qkv.backends.protocol import BACKENDS

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 600, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = qkv.masks.sliding_window(50)
    problem = describe_problem(q, k, v, mask)
    plan = choose_path(problem, "blocks", False, True)
    assert plan.tiles is not None
    out, lse = BACKENDS["blocks"].forward(q, k, v, mask, plan.tiles, problem.scale)
    expected = qkv.attention(q, k, v, mask, backend="math")
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    assert lse.shape == (1, 2, 600)
