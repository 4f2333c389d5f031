"""qkv.attention under torch.compile: graphs, graph breaks and compiled / eager time, per path.

For each path (no mask, causal, sliding_window, documents, varlen, ALiBi, softcap, score_mod)
and dtype (float32, bfloat16) this runs ``torch._dynamo.explain`` on a function that calls
`qkv.attention`, prints its graph count, graph-break count and break reasons, the path
`qkv.explain` names for the eager call and the one torch.compile takes ("blocks" when the
traced graph holds the block engine's operator, `qkv.backends.blocks.ops`; "chunks" for the
math path by query chunks, where a score_mod goes from 65,536 pairs per head; "flex" for
FlexAttention's CPU kernel, which a score_mod with a data mask takes without gradients; "dense" for SDPA
or the whole formula), and the fastest of a few compiled calls over the fastest of a few eager
calls, the two alternating. One run per case on a shared machine: the ratios
are noisy; read them as "about the same" or "several times slower", not as figures. A full
run ends with the same ratio for PyTorch's own SDPA (rows "torch: ..."), called directly: what
torch.compile costs an operator qkv does not own. On a 2-core CPU a compiled training step of
SDPA itself runs a few percent slower than eager at these sizes (AOTAutograd's and Dynamo's
fixed cost per step), the floor for qkv's rows.

Run: ``uv run python benchmarks/compile_modes.py`` (``--n 1024`` sets L = S, default 1,024, which
sends the structured masks to the CPU block engine (at 512, B=1 H=4 E=32, its cost model finds
SDPA with a dense mask faster for the windows); ``--dtype float32`` for one dtype;
``--grad`` times forward and backward (from a fixed gradient; ``--sum-loss`` from ``out.sum()``,
see `compiled_over_eager`); ``--steady-malloc`` keeps glibc from handing freed memory
back to the system (see `keep_freed_memory`); ``--no-time`` for the graph counts only; ``--reasons N``
prints up to N break reasons per case). The block engine's rows at a long sequence, where a
dense mask would cost O(n^2) memory::

    uv run python benchmarks/compile_modes.py --n 16384 --only sliding_window,alibi,relative,sinks,documents,varlen
    uv run python benchmarks/compile_modes.py --n 4096 --grad --dtype float32 --only sliding_window,alibi,documents
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import qkv


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory (no trimming, buffers up to 32 MiB from the heap,
    not fresh mappings), so that a timed call reuses pages instead of faulting new ones in;
    False where the C library is not glibc. Measured here (n = 16,384, documents, forward and
    backward): with glibc's defaults the page faults of the zero-filled gradient buffers made
    eager and compiled differ by up to 7 %, depending on which freed its buffers first; with
    this both ran 10-15 % faster and within 2 % of each other. It changes this process only."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    trim_threshold, mmap_threshold = -1, -3  # glibc's M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
    return bool(mallopt(trim_threshold, ctypes.c_int(2**31 - 1))) and bool(mallopt(mmap_threshold, ctypes.c_int(32 << 20)))


def cases(n: int, dtype: torch.dtype) -> dict[str, dict[str, Any]]:
    """name -> the keyword arguments of `qkv.attention` beyond q, k, v, for every path."""
    ids = torch.repeat_interleave(torch.arange(4), n // 4)  # (n,): four documents of n / 4 tokens
    lengths = [n // 2, n // 4, n - n // 2 - n // 4]  # three packed sequences adding up to n

    def distance_penalty(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return score - 0.01 * (i - j).abs()

    return {
        "no mask": {},
        "causal": {"mask": qkv.masks.causal()},
        "sliding_window": {"mask": qkv.masks.sliding_window(64)},
        "documents": {"mask": qkv.masks.documents(ids)},
        "varlen": {"mask": qkv.masks.varlen(lengths, causal=True)},
        "alibi": {"mask": qkv.masks.causal(), "bias": qkv.bias.alibi()},
        "softcap": {"mask": qkv.masks.causal(), "softcap": 20.0},
        "score_mod": {"score_mod": distance_penalty},
        "score_mod causal": {"mask": qkv.masks.causal(), "score_mod": distance_penalty},
        "score_mod docs": {"mask": qkv.masks.documents(ids), "score_mod": distance_penalty},
        "relative": {"mask": qkv.masks.sliding_window(256), "bias": qkv.bias.relative(torch.randn(4, 32) * 0.1)},
        "sinks": {"mask": qkv.masks.sliding_window(256), "sinks": torch.zeros(4)},
        "key_padding": {"mask": qkv.masks.key_padding(torch.arange(n).view(1, n) < n - n // 8) & qkv.masks.sliding_window(256)},
    }


def traced_path(fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...]) -> str:
    """"blocks" when the graph torch.compile traces for fn holds the block engine's operator
    (`qkv.backends.blocks.ops`), "flex" when it holds FlexAttention (its CPU kernel, for a
    score_mod with a data mask without gradients), "chunks" when it holds checkpointed regions
    (the math path by query chunks, `qkv.backends.query_chunks`), "dense" otherwise (SDPA or the
    whole formula)."""
    targets: list[str] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    torch._dynamo.reset()
    if any("qkv.blocks_forward" in t for t in targets):
        return "blocks"
    if any("flex_attention" in t for t in targets):
        return "flex"
    return "chunks" if any("checkpoint" in t for t in targets) else "dense"


def inputs(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v (1, 4, n, 32)."""
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 4, n, 32, generator=gen).to(dtype) for _ in range(3))


def fastest_times(compiled: Callable[..., torch.Tensor], eager: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], rounds: int) -> tuple[float, float]:
    """The fastest compiled call and the fastest eager call in seconds, the two alternating
    ``rounds`` times (alternating spreads a load spike of a shared machine over both)."""
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for slot, fn in enumerate((compiled, eager)):
            start = time.perf_counter()
            fn(*args)
            best[slot] = min(best[slot], time.perf_counter() - start)
    return best[0], best[1]


def compiled_over_eager(fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], args: argparse.Namespace) -> str:
    """torch.compile(fn) against fn by `fastest_times`, as text: the ratio of the two times, the
    compiled call's extra milliseconds and the eager call's milliseconds ("error ..." when a call
    fails). With ``args.grad`` each call also runs the backward from a fixed gradient in the
    output's own layout, as a model's output projection sends back; with ``args.sum_loss`` from
    ``out.sum()`` instead, whose gradient is one value broadcast (stride 0) and which
    AOTAutograd copies into a full tensor before a compiled backward (eager kernels read it as
    it is), so that the compiled step pays one extra pass over the output."""
    torch._dynamo.reset()
    compiled = torch.compile(fn)
    gradients: dict[int, torch.Tensor] = {}

    def with_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        out = fn(q, k, v)
        if args.sum_loss:
            out.sum().backward()
        else:
            if not gradients:  # one gradient for both, made on the first call; randn_like keeps the output's strides
                gradients[0] = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
            out.backward(gradients[0])
        return out

    run_compiled = functools.partial(with_grad, fn=compiled) if args.grad else compiled
    run_eager = functools.partial(with_grad, fn=fn) if args.grad else fn
    try:
        run_compiled(*inputs)  # compiles
        run_eager(*inputs)  # warm-up of the eager path (plans, kernel builds)
        compiled_s, eager_s = fastest_times(run_compiled, run_eager, inputs, args.rounds)
    except Exception as error:  # a benchmark reports every case, failing or not
        return f"error {type(error).__name__}"
    return f"{compiled_s / eager_s:.2f} {(compiled_s - eager_s) * 1e3:+7.2f} {eager_s * 1e3:8.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024, help="L = S (default 1024)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="both")
    parser.add_argument("--no-time", action="store_true", help="graph counts only")
    parser.add_argument("--reasons", type=int, default=3, help="break reasons printed per case")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timed calls of each (fastest kept)")
    parser.add_argument("--only", type=str, default=None, help="comma-separated case names")
    parser.add_argument("--grad", action="store_true", help="time forward and backward (q, k, v require grad)")
    parser.add_argument("--sum-loss", action="store_true", help="with --grad: backward from out.sum() (see compiled_over_eager)")
    parser.add_argument("--steady-malloc", action="store_true", help="keep freed memory in this process (glibc; see keep_freed_memory)")
    args = parser.parse_args()
    if args.steady_malloc and not keep_freed_memory():
        print("--steady-malloc: this C library has no glibc mallopt; timing with its defaults")
    dtypes = [torch.float32, torch.bfloat16] if args.dtype == "both" else [getattr(torch, args.dtype)]
    malloc = "freed memory kept (--steady-malloc)" if args.steady_malloc else "the C allocator's defaults"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, L = S = {args.n}, B = 1, H = 4, E = 32, {malloc}")
    print(f"time ratio = fastest compiled call / fastest eager call, {args.rounds} alternating rounds after a warm-up "
          "(one run on a shared machine: noisy); +ms = compiled minus eager")
    header = f"{'case':<18}{'dtype':<10}{'path':<8}{'traced':<8}{'graphs':>7}{'breaks':>7}{'ratio':>8}{'+ms':>8}{'eager ms':>9}"
    print(header)
    failures = 0
    for dtype in dtypes:
        qkv_inputs = tuple(x.requires_grad_(args.grad) for x in inputs(args.n, dtype))
        for name, kwargs in cases(args.n, dtype).items():
            if args.only and name not in args.only.split(","):
                continue

            def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict[str, Any] = kwargs) -> torch.Tensor:
                return qkv.attention(q, k, v, **kwargs)

            torch._dynamo.reset()
            path = qkv.explain(*qkv_inputs, **kwargs).path
            traced = traced_path(fn, qkv_inputs)
            try:
                report = torch._dynamo.explain(fn)(*qkv_inputs)
            except Exception as error:  # a benchmark reports every case, failing or not
                failures += 1
                print(f"{name:<18}{str(dtype)[6:]:<10}{path:<8} explain failed: {type(error).__name__}: {str(error)[:200]}")
                continue
            ratio = "" if args.no_time else compiled_over_eager(fn, qkv_inputs, args)
            print(f"{name:<18}{str(dtype)[6:]:<10}{path:<8}{traced:<8}{report.graph_count:>7}{report.graph_break_count:>7}{ratio:>25}")
            for reason in report.break_reasons[: args.reasons]:
                frame = reason.user_stack[-1] if reason.user_stack else None
                where = f" at {frame.filename.split('src/')[-1]}:{frame.lineno}" if frame is not None else ""
                print(f"    - {reason.reason.splitlines()[0][:150]}{where}")
            sys.stdout.flush()
        if not args.no_time and not args.only:
            # PyTorch's own kernel under the same timing: what torch.compile costs an operator
            # that qkv does not own, the floor for the rows above
            for name, is_causal in (("no mask", False), ("causal", True)):
                def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = is_causal) -> torch.Tensor:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

                ratio = compiled_over_eager(reference, qkv_inputs, args)
                print(f"{'torch: ' + name:<18}{str(dtype)[6:]:<10}{'sdpa':<8}{'sdpa':<8}{'':>7}{'':>7}{ratio:>25}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
