"""`qkv.bench.run_suite` in a given dtype, and its peak-memory child process."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from qkv.bench import QUICK, _rss_child
from qkv.bench._suite import _inputs


def test_the_suite_runs_in_the_dtype_it_is_given() -> None:
    config = dataclasses.replace(QUICK, dtype="bfloat16")
    q, k, v = _inputs(64, config, requires_grad=True)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.requires_grad and q.is_leaf
    assert q.shape == (1, QUICK.heads, 64, QUICK.head_dim)


@pytest.mark.parametrize("path", ["qkv", "sdpa"])
def test_the_memory_child_prints_a_peak_per_size(path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _rss_child.main([path, "4", "2", "8", "float32", "16", "64"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [n for n, _ in rows] == [16, 64]
    assert 0 < rows[0][1] <= rows[1][1]  # a high-water mark never falls


def test_the_memory_child_refuses_a_bad_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert _rss_child.main(["flex", "4", "2", "8", "float32", "16"]) == 2
    assert "usage: python -m qkv.bench._rss_child {qkv,sdpa}" in capsys.readouterr().err
