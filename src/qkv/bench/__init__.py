"""Benchmarks as library code: the suite behind `qkv bench` and benchmarks/sparse.py, and the
measuring tools that every script under benchmarks/ and the `quadratic` example share.

- timing: `fastest`, the one timing rule (rotating interleaved rounds, fastest run kept), and
  `FORWARD_ROUND_SECONDS`, its round length for a call divided by the matmul limit;
- rates: `matmul_gflops`, this machine's matrix-multiply rate in a dtype (by default its limit:
  the best over the sides of `LIMIT_SIDES`, `matmul_words` names it), measured in the same
  run as what is compared with it; `machine_matmul_gflops`, the same once per process (what
  `qkv.explain(..., measure=True)` reports);
- memory: `peak_rss_bytes`, `peak_growth` (resident set, Linux's VmHWM) and
  `traced_peak_bytes` (Python's allocations, NumPy's included);
- data: `random_qkv`, `document_ids` / `document_lengths` (packed documents of random
  lengths);
- decode: `decode_steps` (a decode step, qkv vs SDPA, K + V bytes per second against the read
  bandwidth measured in the same run) and `generation` (greedy generation with a random
  Llama-shaped model, qkv vs sdpa), behind `qkv bench --decode` and benchmarks/decode.py;
- the suite: `BenchConfig` (`STANDARD`, `QUICK`), `run_suite` yielding a `BenchReport` of
  `Comparison` rows, which prints itself (`BenchReport.print`) and converts to JSON.

Speed is reported as ratios against the best peer measured in the same run, never asserted
in tests (docs/design.md). Importing this package imports PyTorch; `qkv --help` never does.
"""

from qkv.bench._data import document_ids, document_lengths, random_qkv
from qkv.bench._decode import DecodeRow, GenerationRow, decode_steps, generation
from qkv.bench._memory import (
    PeakGrowth,
    peak_growth,
    peak_rss_bytes,
    status_bytes,
    traced_peak_bytes,
)
from qkv.bench._suite import (
    PEAK_RSS_GOAL_BYTES,
    QUICK,
    STANDARD,
    BenchConfig,
    BenchReport,
    Comparison,
    run_suite,
    steps,
)
from qkv.native.rates import LIMIT_SIDES, machine_matmul_gflops, matmul_gflops, matmul_words
from qkv.native.timing import FORWARD_ROUND_SECONDS, fastest

__all__ = [  # noqa: RUF022  (grouped as the list above, not sorted)
    "fastest", "FORWARD_ROUND_SECONDS", "matmul_gflops", "matmul_words", "LIMIT_SIDES", "machine_matmul_gflops", "peak_rss_bytes", "peak_growth", "PeakGrowth",
    "status_bytes", "traced_peak_bytes", "random_qkv", "document_ids", "document_lengths",
    "BenchConfig", "STANDARD", "QUICK", "BenchReport", "Comparison", "PEAK_RSS_GOAL_BYTES", "run_suite", "steps",
    "DecodeRow", "GenerationRow", "decode_steps", "generation",
]
