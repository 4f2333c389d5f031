"""Validation of attention inputs, done once, before any kernel runs.

`describe_problem` checks q, k, v, mask, scale, dropout and the score terms (bias, softcap,
score_mod) and returns an `AttentionProblem`: the sizes by their docs/design.md letters and the
inputs flattened to one batch axis. Keys and values with batch size 1 broadcast against
queries with a larger batch (one shared context, or a prefix cache). Every
error names the offending shapes or values. PyTorch's own kernels are not trusted to catch
these: its CPU path reads past memory when k and v have different lengths.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from qkv._checks import broadcasts
from qkv._private import torch as private_torch
from qkv.attention.bounds import KVBounds
from qkv.backends import overflow
from qkv.backends.overflow import compact
from qkv.backends.softmax import accumulation_dtype
from qkv.bias import Bias, as_bias
from qkv.masks import Mask
from qkv.scores import ScoreMod, ScoreTerms, check_softcap

__all__ = [
    "AttentionProblem", "autocast_dtype", "check_indices", "compact", "describe_problem", "normalize_mask", "scan_magnitudes",
    "with_traced_check",
]


@dataclass(frozen=True)
class AttentionProblem:
    """A validated attention call, inputs flattened to one batch axis N = prod(batch_shape).

    q (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev). ``mask`` is None, a qkv.masks object,
    or a bool/float tensor (N | 1, H | 1, L, S) (already broadcast on L and S).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | Mask | None
    batch_shape: tuple[int, ...]
    H: int
    G: int
    L: int
    S: int
    E: int
    Ev: int
    scale: float
    dropout: float
    terms: ScoreTerms  # softcap, bias (bound to this problem), score_mod
    # q, k or v holds a NaN or an infinity (see `qkv.attention`'s NaN rule); True while traced
    # (torch.compile, export, vmap): the rule then runs as tensor operations, a no-op on finite inputs
    nonfinite: bool = False
    sinks: torch.Tensor | None = None  # (N | 1, H) attention-sink logits, float32 or wider
    # traced, and the overflow refusal is not in the graph yet (`with_traced_check` adds it)
    traced_check_pending: bool = False

    @property
    def N(self) -> int:
        return self.q.shape[0]

    @property
    def mask_kind(self) -> str:
        """The mask as `qkv.explain` prints it: "none", "bool", "float" or the mask's own description."""
        if self.mask is None:
            return "none"
        if isinstance(self.mask, Mask):
            return self.mask.describe()
        return "bool" if self.mask.dtype == torch.bool else "float"


def autocast_dtype(x: object) -> torch.dtype | None:
    """The dtype torch.autocast asks for on x's device, or None outside autocast (and on
    devices autocast does not know, such as "meta").

    Under autocast qkv's attention behaves like SDPA there: float32 q, k, v are cast to the
    autocast dtype, and autocast is switched off inside so that qkv's own float32 softmax
    state and accumulation (docs/design.md) are not cast down behind its back.
    """
    if not isinstance(x, torch.Tensor):
        return None
    try:
        enabled = torch.is_autocast_enabled(x.device.type)
    except RuntimeError:  # a device type without autocast
        return None
    return torch.get_autocast_dtype(x.device.type) if enabled else None


def _check_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.is_meta:
        raise ValueError(f"{name} is a meta tensor (a shape without data); attention needs tensors that hold values")
    if x.ndim < 3:
        raise ValueError(
            f"{name} must have shape (..., heads, length, dim) with at least 3 dimensions, "
            f"got {tuple(x.shape)}"
        )
    return x


def describe_problem(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Mask | None = None,
    scale: float | None = None,
    dropout: float = 0.0,
    *,
    bias: Bias | torch.Tensor | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    kv_bounds: KVBounds | None = None,
    sinks: torch.Tensor | None = None,
    q_max: float | None = None,
    defer_traced_check: bool = False,
) -> AttentionProblem:
    """Check every input of `qkv.attention` and return the flattened problem (a structured
    mask is checked against the sizes too). ``kv_bounds`` (`qkv.KVCache.bounds`), when it
    describes exactly k and v, replaces the scan of k and v by the data checks; ``q_max``
    (max |q|, inf when q is not finite), given by a caller that scanned q itself (a widened
    call, on the bf16 tensor it copied exactly), replaces the scan of q. ``defer_traced_check``:
    while traced, leave the overflow refusal's graph code out (``traced_check_pending``) for a
    caller that adds it by `with_traced_check` unless the path it chose checks the values itself."""
    if kv_bounds is not None and not isinstance(kv_bounds, KVBounds):
        raise TypeError(f"kv_bounds must be None or a KVBounds (KVCache.bounds), got {type(kv_bounds).__name__}")
    q, k, v = _check_tensor(q, "q"), _check_tensor(k, "k"), _check_tensor(v, "v")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            f"q, k and v must have the same rank, got shapes {tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}"
        )
    batch_shape = tuple(q.shape[:-3])
    if tuple(k.shape[:-3]) != tuple(v.shape[:-3]) or not broadcasts(k.shape[:-3], batch_shape):
        raise ValueError(
            f"q, k and v must share their batch dimensions (k and v may have size 1 there, "
            f"broadcast to q's), got {tuple(q.shape[:-3])}, {tuple(k.shape[:-3])} and {tuple(v.shape[:-3])}"
        )
    H, L, E = q.shape[-3:]
    G, S, E_k = k.shape[-3:]
    G_v, S_v, Ev = v.shape[-3:]
    if E_k != E:
        raise ValueError(f"q and k must share the head dim E: q has E={E}, k has E={E_k}")
    if S_v != S:
        raise ValueError(f"k and v must have the same length S: k has S={S}, v has S={S_v}")
    if G_v != G:
        raise ValueError(f"k and v must have the same number of heads: k has {G}, v has {G_v}")
    if G == 0 or H % G != 0:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads G={G} (grouped-query attention)")
    if min(L, S, E, Ev) == 0 or math.prod(batch_shape) == 0:
        raise ValueError(f"empty inputs: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
    scale = 1.0 / math.sqrt(E) if scale is None else _check_scale(scale)
    scale = float(scale)
    normalized = normalize_mask(mask, q, batch_shape, H, L, S)
    N = math.prod(batch_shape)
    if isinstance(normalized, Mask):  # a size error before the data checks (which may build the scan)
        normalized.validate(N, H, L, S)
    terms = _score_terms(normalized, bias, softcap, score_mod, q, batch_shape, H, L, S)
    sink_logits = _check_sinks(sinks, q, batch_shape, H)  # (N | 1, H) or None
    known = kv_bounds if kv_bounds is not None and not private_torch.host_unreadable(k, v) and kv_bounds.describes(k, v) else None
    bias_top = 0.0 if terms.bias is None else terms.bias.largest(L, S)
    nonfinite = _check_magnitudes(q, k, v, normalized, scale, terms.softcap, bias_top, known, q_max)
    traced = private_torch.host_unreadable(q, k, v, normalized)
    if traced and not defer_traced_check:
        # times the gate (1): the overflow check runs with the graph and raises there
        q = q * _traced_magnitudes(q, k, normalized, scale, terms.softcap, bias_top).to(q.dtype)
    if tuple(k.shape[:-3]) != batch_shape:
        k = k.expand(*batch_shape, G, S, E)  # (..., G, S, E): a view, no copy
        v = v.expand(*batch_shape, G, S, Ev)  # (..., G, S, Ev)
    if q.dim() != 4:  # 4-D inputs are (N, ...) already: no reshape to dispatch (a decode step's cost is in such calls)
        q, k, v = q.reshape(N, H, L, E), k.reshape(N, G, S, E), v.reshape(N, G, S, Ev)  # (N, H, L, E), (N, G, S, E | Ev)
    problem = AttentionProblem(
        q=q,  # (N, H, L, E)
        k=k,  # (N, G, S, E)
        v=v,  # (N, G, S, Ev)
        mask=normalized,
        batch_shape=batch_shape,
        H=H, G=G, L=L, S=S, E=E, Ev=Ev,
        scale=scale,
        dropout=float(dropout),
        terms=terms,
        nonfinite=nonfinite,
        sinks=sink_logits,
        traced_check_pending=traced and defer_traced_check,
    )
    return problem


def with_traced_check(problem: AttentionProblem) -> AttentionProblem:
    """``problem`` with the overflow refusal's graph code that `describe_problem` deferred
    (``traced_check_pending``): q times the gate of `_traced_magnitudes`, as it would have been."""
    if not problem.traced_check_pending:
        return problem
    terms = problem.terms
    bias_top = 0.0 if terms.bias is None else terms.bias.largest(problem.L, problem.S)
    q = problem.q
    gate = _traced_magnitudes(q, problem.k, problem.mask, problem.scale, terms.softcap, bias_top)
    return replace(problem, q=q * gate.to(q.dtype), traced_check_pending=False)


def _check_sinks(sinks: object, q: torch.Tensor, batch_shape: tuple[int, ...], H: int) -> torch.Tensor | None:
    """Attention-sink logits: a finite float32 / float64 tensor broadcastable to (*batch, H) on
    q's device, returned as (N | 1, H) (a view where it can be)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be None or a float tensor (H,) = ({H},), got {type(sinks).__name__}")
    if sinks.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"sinks must be float32 or float64 (an attention-sink logit per head), got {sinks.dtype}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")
    target = (*batch_shape, H)
    if sinks.ndim == 0 or not broadcasts(sinks.shape, target):
        raise ValueError(f"sinks must have shape (H,) = ({H},) or be broadcastable to (*batch, H) = {target}, got {tuple(sinks.shape)}")
    if private_torch.host_unreadable(sinks):
        gate = private_torch.require(torch.isfinite(sinks.detach()).all(), "qkv.attention: sinks must be finite")
        sinks = sinks * gate.to(sinks.dtype)  # times 1: the check runs with the graph
    elif not bool(torch.isfinite(sinks.detach()).all()):
        raise ValueError(f"sinks must be finite, got {sinks.detach().tolist()}")
    if all(n == 1 for n in sinks.shape[:-1]):
        return sinks.reshape(1, -1).expand(1, H)  # (1, H): the same sinks for every batch row
    return sinks.expand(*target).reshape(-1, H)  # (*batch, H) -> (N, H)


def scan_magnitudes(tensors: tuple[torch.Tensor, ...]) -> list[float]:
    """max |x_i| of each tensor (inf when it holds an infinity or a NaN), as the input checks
    scan them (`_largest_magnitudes`), for a caller that scans before it copies the tensors."""
    return _largest_magnitudes(tensors)


def _largest_magnitudes(tensors: tuple[torch.Tensor, ...]) -> list[float]:
    """`qkv.backends.overflow.largest_magnitudes`: one exact reduction per tensor."""
    return overflow.largest_magnitudes(tensors)


def _check_magnitudes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Mask | None,
    scale: float,
    softcap: float | None = None,
    bias_top: float | torch.Tensor = 0.0,
    known: KVBounds | None = None,
    q_max: float | None = None,
) -> bool:
    """Refuse scores that overflow the accumulation dtype (`qkv.backends.overflow`, whose rule
    the block engine's forward operator also runs in compiled code); return whether q, k or v
    is non-finite.

    ``known``: bounds of k and v kept by a KV cache; only q is then scanned, and the decisions
    are the same (the tight bound, when needed, still reads k). ``q_max``: max |q| found by the
    caller; q is then not scanned here.

    Where the values cannot be read on the host (torch.compile, torch.export, vmap) the same
    rule runs as tensor operations (`_traced_magnitudes`) and True is returned: the NaN rule
    then runs as tensor operations too, and leaves finite inputs as they are.
    """
    if private_torch.host_unreadable(q, k, v, mask):
        return True  # describe_problem runs `_traced_magnitudes` instead
    if isinstance(bias_top, torch.Tensor):  # a traced bias bound; on the host it is a number
        bias_top = float(bias_top)
    unknown = ((q,) if q_max is None else ()) + ((k, v) if known is None else ())
    scanned = iter(_largest_magnitudes(unknown) if unknown else [])
    magnitudes = [
        next(scanned) if q_max is None else q_max,
        *((next(scanned), next(scanned)) if known is None else (known.k_max, known.v_max)),
    ]
    top = 0.0
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        with torch.no_grad():
            top = max(0.0, float(compact(mask).max()))
    return overflow.refuse_overflow(q, k, magnitudes, scale, softcap, bias_top, top)


def _traced_largest_norm(x: torch.Tensor) -> torch.Tensor:
    """max_i ||x_i|| over the last axis as a 0-d float64 tensor, for traced graphs: float64
    inputs in float64; others as float32 sums of x / max|x| times max|x| (relative error about
    1e-6, far inside the refusal's margin of 2: the limit is half the largest float), because a
    float64 reduction over bf16 or float32 runs several times slower in Inductor's generated
    code (2.3 ms against 0.3 ms for a (1, 4, 16384, 32) bf16 q, 2 threads). A non-finite entry
    gives a non-finite result, as the float64 norm does."""
    x = x.detach()
    if x.dtype == torch.float64:
        return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64).reshape(-1).amax(dim=0)
    wide = x.to(torch.float32)
    # exact; at most float32's largest whatever the narrower dtype (flattened: ONNX's amax needs a dim)
    top = wide.abs().reshape(-1).amax(dim=0)
    unit = wide / top.clamp(min=torch.finfo(torch.float32).tiny)  # entries in [-1, 1]: the squares cannot overflow
    return torch.linalg.vector_norm(unit, dim=-1).reshape(-1).amax(dim=0).to(torch.float64) * top.to(torch.float64)


def _traced_magnitudes(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | Mask | None,
    scale: float,
    softcap: float | None,
    bias_top: float | torch.Tensor,
) -> torch.Tensor:
    """`_check_magnitudes`' refusal as tensor operations, for graphs whose values the host does
    not see: the tight bound max(1, |scale|) * max_i ||q_i|| * max_j ||k_j|| (the loose bound
    only saves time), checked by `private_torch.require`, which raises when the graph runs; the
    gate it returns (1.0) multiplies q so that compilers keep the check. The message cannot name
    the values, which exist only then."""
    acc = accumulation_dtype(q.dtype)
    limit = torch.finfo(acc).max / 2
    with torch.no_grad():
        q_norm, k_norm = _traced_largest_norm(q), _traced_largest_norm(k)
        finite = torch.isfinite(q_norm) & torch.isfinite(k_norm)  # else the NaN rule applies instead
        scores = max(1.0, abs(scale)) * q_norm * k_norm
        capped = scores if softcap is None else scores.clamp(max=softcap)
        added = torch.as_tensor(bias_top, dtype=torch.float64, device=q.device)
        if isinstance(mask, torch.Tensor) and mask.is_floating_point():
            values = compact(mask).detach()
            # every dim named: ONNX's exporter has no amax over all dims without them
            added = added + values.amax(dim=tuple(range(values.dim()))).to(torch.float64).clamp(min=0.0)
        reach = torch.maximum(scores, capped + added)
        return private_torch.require(
            ~finite | (reach <= limit),
            f"qkv.attention: the scaled scores (max(1, |scale|) * largest |q_i| * largest |k_j|, capped by the "
            f"softcap, plus the largest bias and mask values) reach beyond half the largest "
            f"{str(acc).removeprefix('torch.')} ({limit:.3g}): they would overflow to inf and the softmax would "
            "return NaN; use float64 inputs or smaller q, k, scale or biases (checked inside a traced graph)",
        )


def _check_float_mask(mask: torch.Tensor) -> torch.Tensor:
    """A float mask adds finite values or -inf (hide); NaN and +inf have no meaning. Returns the
    mask (times a gate of 1 while tracing, so that compilers keep the check)."""
    if private_torch.host_unreadable(mask):
        with torch.no_grad():
            bad = (torch.isnan(mask) | torch.isposinf(mask)).any()
        gate = private_torch.require(
            ~bad, "qkv.attention: the float mask holds NaN or +inf; a float mask adds finite values to the scores, "
            "or -inf to hide a key (checked inside a traced graph)",
        )
        return mask * gate.to(mask.dtype)
    with torch.no_grad():
        top = float(mask.max())
        if math.isnan(top) or top == math.inf:
            where = torch.nonzero(torch.isnan(mask) | torch.isposinf(mask))[:3].tolist()
            what = "NaN" if math.isnan(top) else "+inf"
            raise ValueError(
                f"the float mask holds {what} (first at indices {where}); a float mask adds finite values "
                "to the scores, or -inf to hide a key"
            )
    return mask


def _check_scale(scale: object) -> float:
    """A real number (Python, NumPy scalar, or a one-element tensor without gradient) as a float."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.is_complex() or scale.dtype == torch.bool or scale.is_meta:
            raise ValueError(f"scale must be a real number; got a {scale.dtype} tensor of shape {tuple(scale.shape)}")
        if scale.requires_grad:
            raise ValueError(
                "scale is a tensor that requires grad; qkv.attention takes scale as a number and passes "
                "no gradient to it (multiply q by a learned factor instead)"
            )
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"scale must be a finite real number, got {type(scale).__name__} {scale!r}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    return value


def _score_terms(
    mask: torch.Tensor | Mask | None,
    bias: object,
    softcap: object,
    score_mod: object,
    q: torch.Tensor,
    batch_shape: tuple[int, ...],
    H: int,
    L: int,
    S: int,
) -> ScoreTerms:
    """Check bias, softcap and score_mod and bind the bias to this problem."""
    cap = check_softcap(softcap)
    acc = accumulation_dtype(q.dtype)
    if cap is not None and cap > torch.finfo(acc).max:
        # the cap would round to inf in the scores' dtype: s / inf * inf is NaN
        raise ValueError(
            f"softcap={softcap!r} is beyond the largest {str(acc).removeprefix('torch.')} "
            f"({torch.finfo(acc).max:.3g}), the dtype the scores are computed in; a cap that large changes "
            "no score there: pass softcap=None (or float64 inputs)"
        )
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be a function (score, b, h, q_idx, kv_idx) -> score, got {type(score_mod).__name__}")
    resolved = as_bias(bias)
    if bias is not None and resolved is None:
        raise TypeError(f"bias must be None, a qkv.bias object or a float tensor, got {type(bias).__name__}")
    bound = None
    if resolved is not None:
        for t in resolved.tensors():
            if t.device != q.device:
                raise ValueError(f"{resolved.describe()} holds a tensor on {t.device} but q is on {q.device}")
        bound = resolved.bind(batch_shape, H, L, S)
        # defaults made by bind (ALiBi's slopes) live on q's device too; user tensors already do
        bound = bound.with_tensors(tuple(t.to(q.device) for t in bound.tensors()))
    positions = None
    if isinstance(mask, Mask) and (bound is not None or score_mod is not None):
        positions = mask.query_positions(L, S, q.device)
    return ScoreTerms(L, S, cap, bound, score_mod, positions)  # type: ignore[arg-type]


def normalize_mask(
    mask: torch.Tensor | Mask | None,
    q: torch.Tensor,
    batch_shape: tuple[int, ...],
    H: int,
    L: int,
    S: int,
) -> torch.Tensor | Mask | None:
    """Check a mask against (*batch, H, L, S) and bring a tensor mask to (N | 1, H | 1, L, S)."""
    if mask is None or isinstance(mask, Mask):
        return mask
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"mask must be None, a bool or float torch.Tensor, or a qkv.masks object; got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"mask must be bool (True = may attend) or floating point (added to scores), got {mask.dtype}")
    if mask.is_meta:
        raise ValueError("mask is a meta tensor (a shape without data); pass a tensor that holds values")
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    target = (*batch_shape, H, L, S)
    if not broadcasts(mask.shape, target):
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to (*batch, H, L, S) = {target}")
    if mask.is_floating_point():
        mask = _check_float_mask(mask)
    full = mask.reshape((1,) * (len(target) - mask.ndim) + tuple(mask.shape))  # (*batch | 1, H | 1, L | 1, S | 1)
    lead = full.shape[: len(batch_shape)]
    heads = full.shape[-3]
    if all(b == 1 for b in lead):
        full = full.reshape(1, heads, full.shape[-2], full.shape[-1])  # (1, H | 1, L | 1, S | 1)
    else:
        full = full.expand(*batch_shape, heads, full.shape[-2], full.shape[-1])
        full = full.reshape(-1, heads, full.shape[-2], full.shape[-1])  # (N, H | 1, L | 1, S | 1)
    return full.expand(full.shape[0], heads, L, S)  # (N | 1, H | 1, L, S)


def check_indices(
    chosen: Sequence[int] | slice | range | torch.Tensor | None, size: int, name: str, device: torch.device
) -> torch.Tensor:
    """Chosen indices (`qkv.attention_weights`' heads and rows) as a 1-D int64 tensor, checked
    against range(size); None chooses all of them."""
    if chosen is None:
        return torch.arange(size, device=device)
    if isinstance(chosen, slice):
        chosen = range(size)[chosen]
    if isinstance(chosen, (int, str, bytes)) or not isinstance(chosen, (Sequence, range, torch.Tensor)):
        hint = f" (for the single index {chosen} pass [{chosen}])" if isinstance(chosen, int) and not isinstance(chosen, bool) else ""
        raise TypeError(
            f"{name} must be a sequence of ints, a range, a slice or a 1-D integer tensor, "
            f"got {type(chosen).__name__} {chosen!r}{hint}"
        )
    if isinstance(chosen, torch.Tensor):
        if chosen.dtype in (torch.bool,) or chosen.is_floating_point() or chosen.ndim != 1:
            raise TypeError(f"{name} must be a 1-D integer tensor, got dtype {chosen.dtype} shape {tuple(chosen.shape)}")
        idx = chosen.to(device=device, dtype=torch.long)
    else:
        values = list(chosen)
        if any(isinstance(x, bool) or not isinstance(x, int) for x in values):
            raise TypeError(f"{name} must be integers, got {values!r}")
        idx = torch.tensor(values, dtype=torch.long, device=device)
    if idx.numel() == 0:
        raise ValueError(f"{name} selects nothing")
    bad = idx[(idx < 0) | (idx >= size)]
    if bad.numel() > 0:
        raise ValueError(f"{name} must lie in [0, {size}), got {bad.tolist()}")
    return idx
