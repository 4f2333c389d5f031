"""Batches side by side (`qkv.models.batches`): the same embeddings as one batch after another,
the caller's thread count restored whatever happens, and the cases that stay sequential."""

from __future__ import annotations

import threading

import pytest
import torch

import qkv
from qkv.models import Encoder, batches

TEXTS = [f"sentence number {i} " + "with more words " * (i % 7) for i in range(70)]


@pytest.fixture
def two_threads():  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_side_by_side_gives_the_sequential_embeddings(encoder: Encoder, two_threads, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    assert batches.workers(3, torch.device("cpu")) == 2
    seen = []
    side_by_side = encoder.encode(TEXTS, batch_size=16, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(16, 70), (32, 70), (48, 70), (64, 70), (70, 70)]
    assert torch.get_num_threads() == 2
    with qkv.backends.disabled("batch_workers"):
        assert batches.workers(3, torch.device("cpu")) == 1
        sequential = encoder.encode(TEXTS, batch_size=16)
    # float32 throughout; one thread or two per product sums in another order, no more
    torch.testing.assert_close(side_by_side, sequential, atol=1e-5, rtol=0)
    assert not side_by_side.requires_grad


def test_a_failing_batch_raises_and_restores_the_threads(encoder: Encoder, two_threads, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    real = encoder._embed_padded
    calls = []

    def failing(rows):  # type: ignore[no-untyped-def]
        calls.append(len(rows))
        if len(calls) == 2:
            raise RuntimeError("batch 2 failed")
        return real(rows)

    monkeypatch.setattr(encoder, "_embed_padded", failing)
    with pytest.raises(RuntimeError, match="batch 2 failed"):
        encoder.encode(TEXTS, batch_size=8)
    assert torch.get_num_threads() == 2


def test_a_section_sets_and_restores_only_its_own_threads_count(two_threads) -> None:  # type: ignore[no-untyped-def]
    inside, release = threading.Event(), threading.Event()
    counts = []

    def other() -> None:
        before = torch.get_num_threads()
        with batches.one_thread_per_batch():
            counts.append(torch.get_num_threads())
            inside.set()
            release.wait(10)
        counts.append(torch.get_num_threads() == before)

    thread = threading.Thread(target=other)
    thread.start()
    inside.wait(10)
    assert torch.get_num_threads() == 2  # this thread keeps its count
    with batches.one_thread_per_batch():
        assert torch.get_num_threads() == 1
        release.set()
        thread.join()
    assert torch.get_num_threads() == 2
    assert counts == [1, True]


def test_cases_that_stay_sequential(two_threads) -> None:  # type: ignore[no-untyped-def]
    cpu = torch.device("cpu")
    assert batches.workers(1, cpu) == 1  # one batch
    assert batches.workers(4, torch.device("meta")) == 1  # not the CPU
    with torch.autocast("cpu", dtype=torch.bfloat16):  # per thread: workers would not see it
        assert batches.workers(4, cpu) == 1
    assert batches.workers(4, cpu) == 2
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False):  # a dispatch mode, per thread too
        assert batches.workers(4, cpu) == 1
    with torch.device("cpu"):  # a function mode
        assert batches.workers(4, cpu) == 1
    with torch.inference_mode():
        assert batches.workers(4, cpu) == 1
    assert batches.run_batches(lambda i: batches.workers(4, cpu), 3, 2, lambda i: None) == [1, 1, 1]  # inside a worker
    torch.set_num_threads(1)
    assert batches.workers(4, cpu) == 1


def test_a_dispatch_mode_sees_every_batch(encoder: Encoder, two_threads) -> None:  # type: ignore[no-untyped-def]
    # FlopCounterMode is per thread: with batches in worker threads it counted nothing
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        encoder.encode(TEXTS[:8], batch_size=4)
    assert counter.get_total_flops() > 0

