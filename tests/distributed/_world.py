"""Spawn a small gloo world on 127.0.0.1 and collect what every rank returns.

Spawning costs seconds (every process imports torch), so one world runs many cases: the
target receives a `Rank` and a payload, returns a picklable result, and the parent gets the
results in rank order. The parent holds the rendezvous TCPStore on a free port (port 0), so
no port can be taken between choosing and binding it. Every rank runs with one thread.

A rank that raises reports its traceback; a rank that exits without reporting is reported
with its exit code. Nothing waits without a bound: the whole world has a deadline after which
its processes are killed and the test fails.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_HOST = "127.0.0.1"
# Rendezvous and collective bound of the process group. Generous: on a loaded 2-core machine
# a rank can take many seconds to import torch; the ring's own waits use short timeouts.
PG_TIMEOUT = timedelta(seconds=60)


@dataclass
class Rank:
    """What a target sees: its rank, the world size and the rendezvous store."""

    rank: int
    size: int
    store: dist.Store
    out: Any  # the queue to the parent
    abandon: bool = field(default=False)  # set when the process group is left broken on purpose

    def publish(self, values: dict[str, Any]) -> None:
        """Send results now, before a step that may end this process."""
        self.out.put((self.rank, "partial", values))


@dataclass(frozen=True)
class Report:
    rank: int
    ok: bool  # the target returned
    value: dict[str, Any]  # everything published and returned
    error: str = ""  # the traceback when the target raised
    exitcode: int | None = None


def _entry(target: Callable[[Rank, Any], dict[str, Any]], rank: int, size: int, port: int, payload: Any, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore(_HOST, port, size, False, timeout=PG_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=PG_TIMEOUT)
    me = Rank(rank, size, store, out)
    try:
        out.put((rank, "done", target(me, payload)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
        me.abandon = True
    if me.abandon:
        # Pending work on a broken group would make the normal teardown wait for its timeout.
        os._exit(0)
    dist.destroy_process_group()


def run_world(
    target: Callable[[Rank, Any], dict[str, Any]], size: int, payload: Any = None, deadline_s: float = 120.0
) -> list[Report]:
    """Run target(rank, payload) on `size` gloo ranks; return every rank's Report, in rank order."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    store = dist.TCPStore(_HOST, 0, None, True, wait_for_workers=False, timeout=PG_TIMEOUT)
    procs = [ctx.Process(target=_entry, args=(target, r, size, store.port, payload, out)) for r in range(size)]
    for p in procs:
        p.start()
    values: list[dict[str, Any]] = [{} for _ in range(size)]
    finished: dict[int, str] = {}  # rank -> "done" or the traceback

    def drain() -> None:
        while not out.empty():
            rank, kind, value = out.get()
            if kind == "error":
                finished[rank] = value
            else:
                values[rank].update(value)
                if kind == "done":
                    finished[rank] = "done"

    stop = time.monotonic() + deadline_s
    hung: list[int] = []
    try:
        while len(finished) < size and time.monotonic() < stop:
            alive = any(p.is_alive() for p in procs)
            drain()
            if not alive:
                break
            time.sleep(0.02)
        for p in procs:
            p.join(timeout=max(0.1, stop - time.monotonic()))
        drain()
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del store
    if hung:
        raise TimeoutError(f"world of {size} ranks: ranks {hung} were still running after {deadline_s} s")
    return [
        Report(
            r,
            finished.get(r) == "done",
            values[r],
            error=finished.get(r, "exited without finishing") if finished.get(r) != "done" else "",
            exitcode=procs[r].exitcode,
        )
        for r in range(size)
    ]


def results(reports: list[Report]) -> list[Any]:
    """The values of a world in which every rank must have succeeded."""
    failed = [r for r in reports if not r.ok]
    if failed:
        text = "\n".join(f"--- rank {r.rank} (exit code {r.exitcode}):\n{r.error}" for r in failed)
        raise AssertionError(f"{len(failed)} rank(s) failed:\n{text}")
    return [r.value for r in reports]
