"""Encoding batches side by side: one batch per core, each with one intra-op thread.

A sentence encoder's operators are small (a batch of 32 short texts is a few hundred
(batch row, head) attention problems and matrix products of a few thousand rows): split
over two intra-op threads they spend much of their time waiting for each other. Whole batches
in parallel do not: each core runs its own batch start to finish, and PyTorch's operators
(and qkv's compiled kernels) release the GIL while they run.

With PyTorch's OpenMP backend the intra-op thread count belongs to each thread, and a
thread that first uses torch starts from the count set last by any thread:
`one_thread_per_batch` sets the calling thread's count to 1 while the workers are made and
run (each worker sets its own to 1 too) and restores it after, whatever happens. The
caller's other threads keep theirs, except one that first touches torch while the batches
run: it starts with 1 (call ``torch.set_num_threads`` in it to choose).

`workers` says how many batches run at once: the caller's intra-op thread count, at most
the number of batches, and 1 (the ordinary loop) off the CPU, under autocast, a torch
function or dispatch mode or inference mode (per thread in PyTorch: workers would not see
them), inside a worker, or when ``qkv.backends.disabled("batch_workers")`` is in force. Workers run
without gradient, as encoding does, and in a copy of the caller's context (its switches).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

from qkv._private import torch as private_torch
from qkv.native import switches

__all__ = ["one_thread_per_batch", "run_batches", "workers"]

T = TypeVar("T")

_inside = threading.local()  # set in worker threads: their own batches run one by one


def workers(batches: int, device: torch.device) -> int:
    """How many batches to run at once on ``device``: 1, or the intra-op thread count."""
    if switches.is_off("batch_workers") or device.type != "cpu" or batches < 2 or getattr(_inside, "worker", False):
        return 1
    if torch.is_autocast_enabled("cpu"):  # autocast is per thread: workers would not see it
        return 1
    # so are torch function and dispatch modes (FlopCounterMode, set_default_device, ...) and
    # inference mode: under any of them the batches run in the caller's thread, where they apply
    if private_torch.mode_active() or torch.is_inference_mode_enabled():
        return 1
    return max(1, min(torch.get_num_threads(), batches))


@contextmanager
def one_thread_per_batch() -> Iterator[None]:
    """The calling thread's intra-op thread count set to 1 inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _as_worker(fn: Callable[[int], T], index: int) -> T:
    if not getattr(_inside, "worker", False):
        _inside.worker = True
        torch.set_num_threads(1)  # this worker's own count (it started from its creator's)
    with torch.no_grad():  # grad mode is per thread; encoding never records a graph
        return fn(index)


def run_batches(fn: Callable[[int], T], batches: int, count: int, done: Callable[[int], None]) -> list[T]:
    """[fn(0), ..., fn(batches - 1)], ``count`` of them at a time (`workers`); ``done(i)`` is
    called in the caller's thread as results arrive in order. With count 1 this is a plain
    loop on the caller's threads."""
    if count <= 1:
        results = []
        for i in range(batches):
            results.append(fn(i))
            done(i)
        return results
    with one_thread_per_batch(), ThreadPoolExecutor(count, thread_name_prefix="qkv-batch") as pool:
        # each worker in a copy of the caller's context: qkv.backends.disabled(...) holds there too
        futures = [pool.submit(contextvars.copy_context().run, _as_worker, fn, i) for i in range(batches)]
        results = []
        try:
            for i, future in enumerate(futures):
                results.append(future.result())
                done(i)
        except BaseException:  # a batch failed (or the caller interrupted): start no other
            for future in futures:
                future.cancel()
            raise
        return results
