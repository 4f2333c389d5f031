"""The one timing rule of qkv's benchmarks: the fastest of interleaved, rotating rounds.

Machines are shared and noisy, so implementations are compared as ratios of times measured
in the same process, never against an absolute time (docs/design.md). A slow spell of the machine
should hit every contender alike, so they run in rounds: every function once per round, in
an order that rotates from round to round (a b c, b c a, c a b, ...: no function always
follows the same one, whose allocations or spinning threads it would inherit). The fastest
run of each is kept: it is the one least disturbed by other load (``timeit``'s advice).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

__all__ = ["FORWARD_ROUND_SECONDS", "fastest"]

# `fastest`'s round_seconds for one attention call compared with the matmul limit: the call
# runs again within its round until its calls add up to this, as the limit's products do
# (`matmul_gflops`), so a 30 ms call gets as many tries at a quiet moment of a shared machine
# as the limit it is divided by (with one call per round it had 3 to the limit's ~25)
FORWARD_ROUND_SECONDS = 0.25


def fastest(
    fns: Mapping[str, Callable[[], object]],
    repeats: int,
    *,
    warmup: int = 0,
    round_seconds: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Fastest time of each function in seconds, by name, timed in ``repeats`` rotating rounds.

    ``warmup``: untimed calls of each function first (first calls pick kernels, start thread
    pools and allocate). ``round_seconds``: within a round a function faster than this runs
    again until its calls add up to it, so that quick calls get more tries. ``clock``: wall
    time by default; `time.process_time` for the CPU time of this process (steadier on a
    busy machine with one thread, where other processes' time is then not counted).

    >>> sorted(fastest({"a": lambda: None, "b": lambda: None}, repeats=2))
    ['a', 'b']
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    best = dict.fromkeys(names, float("inf"))
    for round_index in range(repeats):
        shift = round_index % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            spent = 0.0
            while True:
                start = clock()
                fns[name]()
                elapsed = clock() - start
                best[name] = min(best[name], elapsed)
                spent += elapsed
                if spent >= round_seconds:
                    break
    return best
