"""Score terms and variable-length sequences: qkv's CPU block engine against its peers, one run.

B = 1, H = 8, E = 64, float32 and bfloat16. Each comparison times qkv and its peer in the same
process (`qkv.bench.fastest`: rotating rounds, fastest run kept) and prints peer time / qkv
time (above 1: qkv is faster), with qkv's
GFLOP/s next to the matmul rate of the same dtype measured in the same run.

- ALiBi + causal + sliding_window(256), n = 16,384: vs SDPA given the equivalent dense float
  mask (ALiBi, -inf outside the window), one head at a time (all 8 heads' float32 masks
  would take 8.6 GB), forward and forward + backward; vs FlexAttention
  (CPU, compiled, inference) with the same score_mod and mask_mod, steady state and first call
  including create_block_mask and compilation.
- softcap 50 + sliding_window(256, 256), n = 16,384: vs FlexAttention as above; vs the math
  path at n = 16,384 when its three (H, n, n) float32 tensors fit in the available memory
  (25 GiB: not on a 24 GiB machine), else at n = 4,096, and the script says so.
- varlen causal, 64 documents, n = 16,384: vs SDPA with the dense bool mask, forward and
  forward + backward; peak resident memory at 65,536 tokens (a fresh process each, VmHWM) of
  the forward, the forward + backward, and the forward + backward with ALiBi, each next to
  its floor (the process after ``import torch, qkv``, the inputs, the output and the
  gradients: what any implementation holds) and the part that is attention's own.

FLOPs: 4 * H * E * (visited pairs) forward (`qkv.explain`), 3.5x that for forward + backward.

Run: ``uv run python benchmarks/scores.py`` (many minutes on 2 cores: SDPA's dense masks cost
n^2 work), ``--n 4096`` for a shorter run, ``--no-flex`` to skip FlexAttention's compilation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import qkv
from qkv.bench import document_lengths, fastest, matmul_gflops, matmul_words, random_qkv

H, E = 8, 64
WINDOW = 256
# score-sized float32 tensors the math path holds at once with a softcap (measured peak of
# qkv.attention(..., softcap=50.0, backend="math") at n = 2,048: 3.1 in float32, 3.2 in bf16)
_MATH_SCORE_TENSORS = 3


def _inputs(n: int, dtype: torch.dtype, grad: bool = False) -> tuple[torch.Tensor, ...]:
    return random_qkv(n, heads=H, head_dim=E, dtype=dtype, requires_grad=grad)


def _row(name: str, ours: float, peer: str, theirs: float, gflop: float, rate: float, goal: float | None = None, err: float | None = None) -> dict:
    ratio = theirs / ours
    achieved = gflop / ours
    verdict = "" if goal is None else f" (goal >= {goal:g}x: {'met' if ratio >= goal else 'NOT met'})"
    extra = "" if err is None else f", max |diff| {err:.2e}"
    print(
        f"  {name}: qkv {ours * 1e3:.0f} ms, {peer} {theirs * 1e3:.0f} ms -> {ratio:.1f}x{verdict}; "
        f"qkv {achieved:.0f} GFLOP/s = {achieved / rate:.0%} of matmul{extra}",
        flush=True,
    )
    return {"case": name, "qkv_s": ours, "peer": peer, "peer_s": theirs, "ratio": ratio, "goal": goal,
            "qkv_gflops": achieved, "matmul_gflops": rate, "max_abs_diff": err}


def _fwd_bwd(fn: Callable[[], torch.Tensor], grad: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        fn().backward(grad)

    return run


def _sdpa_per_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: list[torch.Tensor]) -> torch.Tensor:
    """SDPA with a dense float mask, one head at a time: the (H, n, n) float32 mask of ALiBi
    would be 8.6 GB at n = 16,384; one head's (n, n) mask is 1 GiB and the work is the same."""
    outs = [F.scaled_dot_product_attention(q[:, h : h + 1], k[:, h : h + 1], v[:, h : h + 1], attn_mask=masks[h]) for h in range(H)]
    return torch.cat(outs, dim=1)  # (1, H, n, E)


def alibi_window(n: int, dtype: torch.dtype, rate: float, reps: int) -> list[dict]:
    mask = qkv.masks.causal() & qkv.masks.sliding_window(WINDOW)
    bias = qkv.bias.alibi()
    hidden = ~mask.to_dense(n, n)[0, 0]  # (n, n)
    slopes = qkv.bias.alibi_slopes(H)
    distance = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs().float()  # (n, n)
    masks = [(-float(slopes[h]) * distance).masked_fill_(hidden, float("-inf")) for h in range(H)]  # H x (n, n) float32
    del distance, hidden
    peer = "SDPA dense float mask (per head)"
    q, k, v = _inputs(n, dtype)
    gflop = qkv.explain(q, k, v, mask, bias=bias).flops / 1e9
    rows = []
    with torch.no_grad():
        ours = qkv.attention(q, k, v, mask, bias=bias)
        theirs = _sdpa_per_head(q, k, v, masks)
        err = float((ours.float() - theirs.float()).abs().max())
        t = fastest(
            {"qkv": lambda: qkv.attention(q, k, v, mask, bias=bias), "sdpa": lambda: _sdpa_per_head(q, k, v, masks)}, reps, warmup=1)
    rows.append(_row(f"ALiBi + causal + window({WINDOW}) forward, n={n}", t["qkv"], peer, t["sdpa"], gflop, rate, 15, err))
    qg, kg, vg = _inputs(n, dtype, grad=True)
    grad = torch.randn(qg.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    t = fastest(
        {"qkv": _fwd_bwd(lambda: qkv.attention(qg, kg, vg, mask, bias=bias), grad),
         "sdpa": _fwd_bwd(lambda: _sdpa_per_head(qg, kg, vg, masks), grad)}, reps, warmup=1)
    rows.append(_row(f"ALiBi + causal + window({WINDOW}) fwd+bwd, n={n}", t["qkv"], peer, t["sdpa"], 3.5 * gflop, rate, 8))
    return rows


def alibi_window_flex(n: int, dtype: torch.dtype, rate: float, reps: int) -> list[dict]:
    mask = qkv.masks.causal() & qkv.masks.sliding_window(WINDOW)
    bias = qkv.bias.alibi()
    slopes = qkv.bias.alibi_slopes(H).float()
    q, k, v = _inputs(n, dtype)
    gflop = qkv.explain(q, k, v, mask, bias=bias).flops / 1e9
    return _flex(n, dtype, rate, reps, "ALiBi + causal + window", lambda s, b, h, i, j: s - slopes[h] * (i - j),
                 lambda b, h, i, j: (j <= i) & (i - j <= WINDOW), mask, {"bias": bias}, gflop)


def _flex(n: int, dtype: torch.dtype, rate: float, reps: int, name: str, score_mod, mask_mod, mask, kwargs, gflop) -> list[dict]:
    """FlexAttention on CPU, compiled: first call (create_block_mask + compile) and steady state."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = _inputs(n, dtype)
    with torch.no_grad():
        start = time.perf_counter()
        ours = qkv.attention(q, k, v, mask, **kwargs)
        ours_first = time.perf_counter() - start
        try:
            compiled = torch.compile(flex_attention, dynamic=False)
            start = time.perf_counter()
            block_mask = create_block_mask(mask_mod, None, None, n, n, device="cpu")
            theirs = compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
            flex_first = time.perf_counter() - start
        except Exception as error:  # report what FlexAttention cannot do here
            print(f"  FlexAttention {name} {dtype}: failed ({type(error).__name__}: {str(error)[:200]})", flush=True)
            return []
        err = float((ours.float() - theirs.float()).abs().max())
        t = fastest(
            {"qkv": lambda: qkv.attention(q, k, v, mask, **kwargs),
             "flex": lambda: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)}, reps, warmup=1)
    return [
        _row(f"{name} forward, n={n}", t["qkv"], "FlexAttention compiled (steady)", t["flex"], gflop, rate, None, err),
        _row(f"{name} first call, n={n}", ours_first, "FlexAttention incl. block mask + compile", flex_first, gflop, rate),
    ]


def _available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None elsewhere)."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _math_length(n: int, requested: int | None) -> int:
    """The length of the softcap comparison with the math path: ``requested``, else n when the
    math path's score-sized float32 tensors fit in the memory available now, else 4,096, saying why."""
    if requested is not None:
        return requested
    need = _MATH_SCORE_TENSORS * H * n * n * 4
    available = _available_bytes()
    if available is not None and need < 0.8 * available:
        return n
    print(f"  softcap vs the math path at n={n} not run: the math path holds about {_MATH_SCORE_TENSORS} "
          f"(H, n, n) float32 tensors (scores, softcapped scores, weights; float32 in bf16 too) = "
          f"{need / 2**30:.1f} GiB, and {'?' if available is None else f'{available / 2**30:.1f} GiB'} is "
          f"available; compared at n=4096 instead (--math-n to choose)", flush=True)
    return 4096


def softcap_window(n: int, dtype: torch.dtype, rate: float, reps: int, flex: bool, math_n: int) -> list[dict]:
    mask = qkv.masks.sliding_window(WINDOW, WINDOW)
    rows = []
    q, k, v = _inputs(math_n, dtype)
    gflop = qkv.explain(q, k, v, mask, softcap=50.0).flops / 1e9
    with torch.no_grad():
        ours = qkv.attention(q, k, v, mask, softcap=50.0)
        theirs = qkv.attention(q, k, v, mask, softcap=50.0, backend="math")
        err = float((ours.float() - theirs.float()).abs().max())
        t = fastest(
            {"qkv": lambda: qkv.attention(q, k, v, mask, softcap=50.0),
             "math": lambda: qkv.attention(q, k, v, mask, softcap=50.0, backend="math")}, reps, warmup=1)
    rows.append(_row(f"softcap 50 + window({WINDOW}, {WINDOW}) forward, n={math_n}", t["qkv"], "math path", t["math"], gflop, rate, None, err))
    if flex:
        q, k, v = _inputs(n, dtype)
        gflop = qkv.explain(q, k, v, mask, softcap=50.0).flops / 1e9
        rows += _flex(n, dtype, rate, reps, "softcap 50 + window", lambda s, b, h, i, j: torch.tanh(s / 50.0) * 50.0,
                      lambda b, h, i, j: (i - j <= WINDOW) & (j - i <= WINDOW), mask, {"softcap": 50.0}, gflop)
    return rows


def varlen_docs(n: int, dtype: torch.dtype, rate: float, reps: int) -> list[dict]:
    lengths = document_lengths(n, 64, seed=2)
    mask = qkv.masks.varlen(lengths, causal=True)
    dense = mask.to_dense(n, n)  # (1, 1, n, n) bool
    q, k, v = _inputs(n, dtype)
    gflop = qkv.explain(q, k, v, mask).flops / 1e9
    with torch.no_grad():
        err = float((qkv.attention(q, k, v, mask).float() - F.scaled_dot_product_attention(q, k, v, attn_mask=dense).float()).abs().max())
        t = fastest(
            {"qkv": lambda: qkv.attention(q, k, v, mask),
             "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)}, reps, warmup=1)
    rows = [_row(f"varlen causal, 64 docs, forward, n={n}", t["qkv"], "SDPA dense bool mask", t["sdpa"], gflop, rate, 20, err)]
    qg, kg, vg = _inputs(n, dtype, grad=True)
    grad = torch.randn(qg.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    t = fastest(
        {"qkv": _fwd_bwd(lambda: qkv.attention(qg, kg, vg, mask), grad),
         "sdpa": _fwd_bwd(lambda: F.scaled_dot_product_attention(qg, kg, vg, attn_mask=dense), grad)}, reps, warmup=1)
    rows.append(_row(f"varlen causal, 64 docs, fwd+bwd, n={n}", t["qkv"], "SDPA dense bool mask", t["sdpa"], 3.5 * gflop, rate))
    return rows


# One peak-memory case in a fresh process (VmHWM is that process's own peak): the resident
# set after `import torch, qkv` is measured before the inputs exist, so that the floor below
# is what any implementation must hold, and the rest is attention's own.
_PEAK = """
import json, sys, torch, qkv
from qkv.bench import document_lengths, peak_rss_bytes, random_qkv, status_bytes
n, dtype, case = int(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3]
imported = status_bytes("VmRSS")
backward = case != "fwd"
bias = qkv.bias.alibi() if case == "alibi-fwdbwd" else None
mask = qkv.masks.varlen(document_lengths(n, 64, seed=2), causal=True)
q, k, v = random_qkv(n, dtype=dtype, requires_grad=backward)
if backward:
    qkv.attention(q, k, v, mask, bias=bias).sum().backward()
else:
    with torch.no_grad():
        out = qkv.attention(q, k, v, mask, bias=bias)
print(json.dumps({"peak": peak_rss_bytes(), "imported": imported}))
"""
_PEAK_CASES = {
    "fwd": "varlen causal, forward (inference)",
    "fwdbwd": "varlen causal, forward + backward",
    "alibi-fwdbwd": "varlen causal + ALiBi, forward + backward",
}


def peak_memory(n: int, dtype: torch.dtype, case: str) -> dict:
    """Peak resident set of one case at n tokens (64 documents, H = 8, E = 64), next to its floor:
    the process after ``import torch, qkv``, q, k, v, the output, and for a backward dq, dk, dv."""
    name = str(dtype).removeprefix("torch.")
    out = subprocess.run([sys.executable, "-c", _PEAK, str(n), name, case], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    tensor = H * n * E * torch.empty((), dtype=dtype).element_size()  # one of q, k, v, out, dq, dk, dv
    floor = got["imported"] + (7 if case != "fwd" else 4) * tensor
    peak = got["peak"]
    verdict = "met" if peak < 1.5e9 else "NOT met"
    print(f"  peak RSS {_PEAK_CASES[case]}, n={n}: {peak / 1e9:.2f} GB = {peak / 2**30:.2f} GiB (goal < 1.5 GB: {verdict}); "
          f"floor {floor / 1e9:.2f} GB (torch + qkv {got['imported'] / 1e9:.2f}, q k v + output{' + dq dk dv' if case != 'fwd' else ''} "
          f"{(floor - got['imported']) / 1e9:.2f}); attention's own {(peak - floor) / 1e9:.2f} GB", flush=True)
    return {"case": f"peak RSS {case} n={n}", "dtype": name, "peak_bytes": peak, "floor_bytes": floor,
            "imported_bytes": got["imported"]}


_CASES = ("alibi", "softcap", "varlen", "peak")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384, help="sequence length (default 16,384)")
    parser.add_argument("--math-n", type=int, default=None,
                        help="length of the softcap comparison with the math path (default: --n if it fits in memory, else 4,096)")
    parser.add_argument("--peak-n", type=int, default=65536, help="tokens of the peak-memory run")
    parser.add_argument("--reps", type=int, default=3, help="rotating rounds (fastest run kept)")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--cases", default=",".join(_CASES), help=f"comma-separated subset of {', '.join(_CASES)}")
    args = parser.parse_args()
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(_CASES))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(_CASES)}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="qkv-bench-inductor-"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()}", flush=True)
    rows: list[dict] = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        rate = matmul_gflops(dtype)
        print(f"{name}: matmul {rate:.0f} GFLOP/s ({matmul_words()}, before the cases)", flush=True)
        warm = _inputs(512, dtype, grad=True)
        qkv.attention(*warm, qkv.masks.causal(), bias=qkv.bias.alibi(), softcap=50.0).sum().backward()
        if "alibi" in cases:
            rows += alibi_window(args.n, dtype, rate, args.reps)
            if not args.no_flex:
                rows += alibi_window_flex(args.n, dtype, rate, args.reps)
        if "softcap" in cases:
            rows += softcap_window(args.n, dtype, rate, args.reps, not args.no_flex, _math_length(args.n, args.math_n))
        if "varlen" in cases:
            rows += varlen_docs(args.n, dtype, rate, args.reps)
        if "peak" in cases:
            rows += [peak_memory(args.peak_n, dtype, case) for case in _PEAK_CASES]
        print(f"{name}: matmul {matmul_gflops(dtype):.0f} GFLOP/s after the cases", flush=True)
    print(f"load average at the end {os.getloadavg()}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
