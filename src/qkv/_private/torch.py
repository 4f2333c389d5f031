"""PyTorch's private operators and checks that qkv calls (checked against torch 2.15).

- ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward: the CPU flash
  kernel behind SDPA, called directly because it returns the log-sum-exp that SDPA drops and
  its backward takes that lse (the fused path's lse, the block engine, ring attention);
- ``mkldnn::_linear_pointwise``: oneDNN's linear with a fused activation, the op Inductor uses
  for frozen models (`qkv.native.onednn_linear`);
- ``torch._softmax_backward_data``: the softmax's own backward in one pass;
- ``torch._C._functorch.is_functorch_wrapped_tensor`` and ``torch._is_functional_tensor``: a
  tensor whose data pointer is not its values (vmap, grad, functionalization);
- ``torch._C._functorch.is_batchedtensor`` / ``is_gradtrackingtensor`` / ``get_unwrapped`` and
  ``torch._subclasses.fake_tensor.is_fake``: whether a tensor's values can be read on the host
  now (not under vmap, not a fake tensor of torch.compile / export), and whether torch.func
  wraps it;
- ``torch._C._dispatch_tls_local_include_set`` / ``_dispatch_tls_local_exclude_set`` and
  ``torch._C._ForceDispatchKeyGuard``: autograd switched back on inside a custom operator's
  implementation, which runs below autograd (`autograd_inside_operator`);
- ``torch._C._len_torch_function_stack`` / ``_len_torch_dispatch_stack``: whether a torch
  function or dispatch mode is active in this thread;
- ``torch._subclasses.fake_tensor.unset_fake_temporarily``: real tensors for a moment while a
  fake tensor mode traces (`real_tensors`: the block engine's planner inside dispatch);
- ``torch.cpu._is_avx2_supported`` ... ``_is_amx_fp16_supported``: the CPU features PyTorch
  itself detected (`qkv.native.machine`'s tier); a release without one claims less;
- ``torch.compiler._is_exporting_flag``: whether torch.export is tracing, the flag behind
  ``torch.compiler.is_exporting()``, read directly (`is_exporting`);
- ``nn.Module``'s hook dictionaries (``module._forward_hooks`` ... and the global ones in
  ``torch.nn.modules.module``): whether ``module(x)`` would run a hook.

`PRIVATE_OPS` lists the operators and their schemas as this torch declares them;
tests/_private/test_torch.py checks them against the installed torch.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.modules import module as _module

__all__ = [
    "CHECKED_WITH",
    "CPU_FEATURE_QUERIES",
    "PRIVATE_OPS",
    "autograd_inside_operator",
    "cpu_flash_attention",
    "cpu_flash_attention_backward",
    "cpu_supports",
    "has_cpu_flash_attention",
    "hooks_would_run",
    "host_unreadable",
    "is_exporting",
    "is_wrapped_tensor",
    "mode_active",
    "onednn_linear_pointwise",
    "onnx_exporting",
    "real_tensors",
    "require",
    "softmax_backward",
    "traced_floats_symbolic",
    "traced_sizes_symbolic",
    "under_torch_func",
]

@torch.compiler.assume_constant_result
def onnx_exporting() -> bool:
    """Whether torch.onnx (either exporter) is exporting. Run when called, not traced (a constant
    to Dynamo, as an export traces once): Dynamo folds ``torch.onnx.is_in_onnx_export()`` to
    False, and the dynamo exporter retries a failed capture with torch.export's strict (Dynamo)
    mode, where qkv would then trace the kernels ONNX has no operator for; so the exporter's
    own flag is read too; one function instead of two. False at once where torch.onnx was never
    imported: no export runs then, and reading the flag must not import it (about 90 ms)."""
    if "torch.onnx" not in sys.modules:
        return False
    flags = sys.modules.get("torch.onnx._internal.exporter._flags")
    return torch.onnx.is_in_onnx_export() or bool(getattr(flags, "_is_onnx_exporting", False))


def is_exporting() -> bool:
    """Whether torch.export (or an ONNX export through it) is tracing: what
    ``torch.compiler.is_exporting()`` answers on PyTorch 2.15, eager or traced, on every release.
    The function itself will not do: Dynamo in 2.7 to 2.10 answers True inside any
    torch.compile (qkv then took its export variants there), and 2.6 has none (reading it
    while Dynamo traces is an internal error). 2.6 has no flag either (False), and 2.7's strict
    export (Dynamo's) does not set it: there qkv takes torch.compile's choices."""
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


# The torch release these names and schemas were checked against; pyproject.toml allows < 2.16.
CHECKED_WITH = "2.15"

# namespace, operator name, overload: what `PRIVATE_OPS`' test looks up.
PRIVATE_OPS = (
    ("aten", "_scaled_dot_product_flash_attention_for_cpu", "default"),
    ("aten", "_scaled_dot_product_flash_attention_for_cpu_backward", "default"),
    ("mkldnn", "_linear_pointwise", "default"),
    ("aten", "_softmax_backward_data", "default"),
)

# The CPU feature a query answers, and the torch.cpu function that answers it.
CPU_FEATURE_QUERIES = {
    "avx2": "_is_avx2_supported",
    "avx512": "_is_avx512_supported",
    "avx512_bf16": "_is_avx512_bf16_supported",
    "amx_tile": "_is_amx_tile_supported",
    "amx_fp16": "_is_amx_fp16_supported",
}


def cpu_supports(feature: str) -> bool:
    """Whether PyTorch detected ``feature`` (a key of `CPU_FEATURE_QUERIES`) on this CPU; False
    where this torch has no such query."""
    query = getattr(torch.cpu, CPU_FEATURE_QUERIES[feature], None)
    return bool(query()) if callable(query) else False


def has_cpu_flash_attention() -> bool:
    """Whether this PyTorch has the CPU flash-attention kernels, forward and backward."""
    ops = torch.ops.aten
    return hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
        ops, "_scaled_dot_product_flash_attention_for_cpu_backward"
    )


def cpu_flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (N, H, L, Ev), lse (N, H, L)) of PyTorch's CPU flash kernel; q (N, H, L, E),
    k (N, H, S, E), v (N, H, S, Ev); ``is_causal`` is top-left."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[:2]
    return out, lse


def cpu_flash_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the CPU flash kernel, from the forward's saved out and lse."""
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return dq, dk, dv


def onednn_linear_pointwise():  # type: ignore[no-untyped-def]
    """oneDNN's fused linear op; AttributeError or RuntimeError where this build has none."""
    return torch.ops.mkldnn._linear_pointwise


def softmax_backward(grad: torch.Tensor, probs: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """P * (dP - rowsum(dP * P)) along ``dim``: the softmax's backward from its output."""
    return torch._softmax_backward_data(grad, probs, dim, dtype)  # pyright: ignore[reportPrivateImportUsage]  # private, not re-exported


def is_wrapped_tensor(x: torch.Tensor) -> bool:
    """Whether ``x`` is a functorch wrapper (vmap, grad) or a functional tensor, whose data
    pointer does not address its values."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor(x)  # pyright: ignore[reportAttributeAccessIssue]  # no stub
    return bool(wrapped or torch._is_functional_tensor(x))  # pyright: ignore[reportPrivateImportUsage]  # private


def _functorch_layers(x: torch.Tensor) -> list[torch.Tensor]:
    """x and the tensors its functorch wrappers (vmap, grad, functionalize) wrap, outermost first."""
    layers = [x]
    while torch._C._functorch.is_functorch_wrapped_tensor(layers[-1]):  # pyright: ignore[reportAttributeAccessIssue]  # no stub
        layers.append(torch._C._functorch.get_unwrapped(layers[-1]))  # pyright: ignore[reportAttributeAccessIssue]
    return layers


def host_unreadable(*tensors: object) -> bool:
    """Whether the values of these tensors cannot be read on the host now: torch.compile or
    torch.export is tracing (the tensors are fake), or a tensor is batched by vmap at some
    level of its functorch wrappers, or a fake tensor. Code that would read a value
    (``.item()``, ``bool(t)``, NumPy) then takes a path of tensor operations instead. grad and
    functionalize wrappers alone leave the values readable."""
    if torch.compiler.is_compiling():
        return True
    from torch._subclasses.fake_tensor import (
        is_fake,  # private; imported late: it loads the tracing machinery
    )

    return any(
        isinstance(t, torch.Tensor)
        and not _plain(t)
        and (is_fake(t) or any(torch._C._functorch.is_batchedtensor(x) for x in _functorch_layers(t)))  # pyright: ignore[reportAttributeAccessIssue]
        for t in tensors
    )


def _trace_symbols() -> list:
    """The symbols of the shape environment of the graph torch.compile is tracing now (none
    outside a trace)."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    fake_mode = None if context is None else context.fake_mode
    shape_env = None if fake_mode is None else fake_mode.shape_env
    return [] if shape_env is None else list(shape_env.var_to_range)


@torch.compiler.assume_constant_result
def traced_floats_symbolic() -> bool:
    """Whether the graph torch.compile is tracing now holds a symbolic float (a Python float it
    traces as a variable: with ``dynamic=True``, or once a float argument changed and it
    recompiled). FlexAttention refuses a score_mod that reads one ("can only be of Tensor, int,
    SymInt"), a failed compile (`qkv.attention.dispatch._traced_flex`). Run when called, not
    traced (a constant to Dynamo): it reads the trace's own shape environment."""
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    return any(symbol_is_type(symbol, (SymT.FLOAT, SymT.UNBACKED_FLOAT)) for symbol in _trace_symbols())


@torch.compiler.assume_constant_result
def traced_sizes_symbolic() -> bool:
    """Whether the graph torch.compile is tracing now holds a symbolic size or int (with
    ``dynamic=True``, or once a size changed and it recompiled with automatic dynamic shapes).
    Dynamo shows a symbolic size to traced code as an int (``type(n) is int`` holds), so code
    that must not feed one to a constant function or a format spec asks this instead. Run when
    called, not traced (a constant to Dynamo). It answers for the whole graph, not one size: a
    graph with a symbolic batch size counts too."""
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    return any(symbol_is_type(symbol, (SymT.SIZE, SymT.UNBACKED_INT)) for symbol in _trace_symbols())


def _plain(t: torch.Tensor) -> bool:
    """Whether t is an ordinary tensor: of the class torch.Tensor itself (a fake tensor is of a
    subclass) and neither a functorch nor a functional wrapper. Its values are readable, found
    in a few C calls (`host_unreadable` runs several times per `qkv.attention` call)."""
    return (
        type(t) is torch.Tensor
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)  # pyright: ignore[reportAttributeAccessIssue]  # no stub
        and not torch._is_functional_tensor(t)  # pyright: ignore[reportPrivateImportUsage]  # private
    )


def under_torch_func(x: torch.Tensor) -> bool:
    """Whether x is wrapped by torch.func's vmap or grad (jacrev, jacfwd, hessian are built of
    them): their backward passes run under vmap, where kernels without a batching rule (SDPA's
    CPU flash kernels) fall back to a slow loop."""
    return any(
        torch._C._functorch.is_batchedtensor(t) or torch._C._functorch.is_gradtrackingtensor(t)  # pyright: ignore[reportAttributeAccessIssue]
        for t in _functorch_layers(x)
    )


@torch.library.custom_op("qkv::check", mutates_args=())
def _check_op(condition: torch.Tensor, message: str) -> torch.Tensor:
    """1.0 (a 0-d float32 tensor) when every entry of ``condition`` is True; ValueError(message)
    otherwise, the type eager code raises for the same bad input. An operator, so that traced
    graphs keep it and run it with real values."""
    if not bool(condition.all()):
        raise ValueError(message)
    return torch.ones((), dtype=torch.float32, device=condition.device)


@_check_op.register_fake
def _check_op_fake(condition: torch.Tensor, message: str) -> torch.Tensor:
    return torch.empty((), dtype=torch.float32, device=condition.device)


def _check_op_vmap(info, in_dims, condition, message):  # type: ignore[no-untyped-def]  # torch.library's vmap rule
    del info, in_dims  # a batched condition is checked for every batch entry at once
    return _check_op(condition, message), None


_check_op.register_vmap(_check_op_vmap)


def require(condition: torch.Tensor, message: str) -> torch.Tensor:
    """A gate for a check that the host cannot make while tracing: 1.0 (0-d float32) when the
    bool tensor ``condition`` holds everywhere, ValueError(message) when the graph runs
    otherwise. The caller multiplies a tensor it uses by the gate: compilers drop an operator
    whose result nothing reads (``torch._assert_async`` is kept, but Inductor's CPU code
    terminates the process on it instead of raising)."""
    if is_exporting() and onnx_exporting():
        # ONNX has no operator for this check: an ONNX graph carries none (documented in qkv.attention)
        return torch.ones((), dtype=torch.float32, device=condition.device)
    return _check_op(condition.detach(), message)


@torch.library.custom_op("qkv::finite_entries", mutates_args=())
def _finite_entries_op(x: torch.Tensor) -> torch.Tensor:
    """A copy of x with every NaN and infinity replaced by 0, in x's layout."""
    out = torch.empty_like(x)
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0, out=out)


@_finite_entries_op.register_fake
def _finite_entries_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _finite_entries_backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    # The identity, also at the replaced entries: the NaN rule sets every row that reads one to
    # NaN afterwards (`qkv.attention.nan_rule.poison`), and those rows pass no gradient, so none
    # reaches them (a row that cannot see a key gives it probability 0). Eager's torch.where
    # gives the same zeros; here the compiled backward keeps nothing of x (no setup_context).
    del ctx
    return grad


def _finite_entries_vmap(info, in_dims, x):  # type: ignore[no-untyped-def]  # torch.library's vmap rule
    del info  # entry by entry: the batched tensor is cleaned as a whole
    return _finite_entries_op(x), in_dims[0]


_finite_entries_op.register_autograd(_finite_entries_backward)
_finite_entries_op.register_vmap(_finite_entries_vmap)


def finite_entries(x: torch.Tensor) -> torch.Tensor:
    """x with every NaN and infinity replaced by 0, the NaN rule's clean inputs (no gradient
    reaches those entries: see `_finite_entries_backward`). While torch.compile traces it is
    an operator (``qkv::finite_entries``): the same thing as graph code makes Inductor save a
    bool tensor of the finite entries for the backward, and its CPU code writes bool tensors
    slowly (torch 2.15, 2 threads: 1.9 ms for three (1, 4, 2048, 32) float32 masks, against
    0.15 ms to clean the three tensors), about a third of a compiled dense call at that size,
    with the row scans below. Exports keep the graph code: an exported dense path stays made of
    PyTorch's own operators (ONNX and AOTInductor know no Python operator). So do eager vmap and
    grad: torch.func's transforms do not differentiate a ``torch.library`` operator's autograd
    formula."""
    if torch.compiler.is_compiling() and not is_exporting():
        return _finite_entries_op(x)
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def nonfinite_rows(x: torch.Tensor) -> torch.Tensor:
    """(...,) bool: whether each row of x (..., E) holds a NaN or an infinity. While traced it is
    found by a float reduction (a row's largest magnitude is NaN or infinite exactly then),
    which Inductor fuses into one read of x; ``~isfinite(x).all(-1)`` would first write a bool
    tensor of x's size (see `finite_entries`). Not ``isnan((x * 0).sum(-1))``: Inductor in
    PyTorch 2.10, 2.12 and 2.13 folds ``x * 0`` to 0 (2.6, 2.14 and 2.15 do not), and the NaN
    rule found no row."""
    if host_unreadable(x):
        if x.shape[-1] == 0:  # no entries: every row is finite (amax refuses an empty row)
            return torch.zeros(x.shape[:-1], dtype=torch.bool, device=x.device)
        return ~torch.isfinite(x.abs().amax(dim=-1))
    return ~torch.isfinite(x).all(dim=-1)


@contextlib.contextmanager
def autograd_inside_operator() -> Iterator[None]:
    """Autograd available again inside a ``torch.library`` operator's implementation, which the
    dispatcher runs with the autograd keys excluded (``torch.enable_grad`` alone does not bring
    them back): for a backward operator that differentiates tile by tile with torch.autograd.grad.
    Grad mode is off in the block, as in an autograd Function's backward: the code inside turns it
    on around what it differentiates. On, every op on the operator's inputs (q, k, v require grad
    there) would record a graph: a scored backward at n = 1,024 took 7 % longer (7.04 against 6.60 ms)."""
    keys = torch._C.DispatchKey
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor):
        excluded = excluded.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), torch.no_grad():
        yield


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """Tensors made in this block are real ones, also while a fake tensor mode is active
    (torch.compile, torch.export, ``qkv.explain`` of fake inputs): for host-side planning whose
    inputs are plain Python values."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield


def mode_active() -> bool:
    """Whether a torch function mode or dispatch mode (FlopCounterMode, set_default_device,
    ...) is active in this thread."""
    return bool(torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack())


def hooks_would_run(module: nn.Module) -> bool:
    """Whether calling ``module`` would run a hook of its own or a global module hook (the
    dictionaries nn.Module.__call__ reads before it takes its fast path)."""
    own = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    shared = (_module._global_forward_hooks, _module._global_forward_pre_hooks,
              _module._global_backward_hooks, _module._global_backward_pre_hooks)  # fmt: skip
    return any(own) or any(shared)
