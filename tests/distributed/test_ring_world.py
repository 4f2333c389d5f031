"""Ring attention in real gloo worlds of 2 and 4 processes on 127.0.0.1.

Each world is spawned once (module-scoped fixture) and runs every case; the tests then check
what the ranks sent back: outputs and gradients against single-process `qkv.attention` and
the float64 NumPy reference, contiguous and zigzag, causal and not, GQA, E != Ev, uneven
lengths, subgroups, bad inputs, and peers that stall or crash (an error, never a hang).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from qkv.distributed import unshard
from tests.distributed._ring_cases import (
    DTYPES,
    RingCase,
    cases,
    naive,
    reference,
    single_process,
    world_suite,
)
from tests.distributed._world import results, run_world

# Seconds the ring waits for a faulty peer: P=2 worlds end with stalled peers (the test takes
# that long), P=4 worlds with a crashed one (connections close, the error comes at once).
FAULT_TIMEOUT = {2: 1.5, 4: 10.0}
FIELDS = ("out", "dq", "dk", "dv")
FLOAT32_FLOOR = 1e-7  # about one float32 ulp at 1: the "small floor" of docs/design.md's rule
CASE_NAMES = [c.name for c in cases(2)]

pytestmark = pytest.mark.slow  # each world spawns processes that import torch: tens of seconds


@dataclass
class World:
    size: int
    cases: dict[str, tuple[RingCase, dict[str, np.ndarray]]]
    ranks: list[dict[str, Any]]
    subgroup: tuple[RingCase, list[dict[str, np.ndarray]]]

    def gathered(self, name: str) -> dict[str, np.ndarray]:
        """The full output and gradients of case `name`, reassembled from every rank's shard."""
        case = self.cases[name][0]
        return {
            f: unshard([torch.from_numpy(r["cases"][name][f]) for r in self.ranks], case.layout).numpy()  # type: ignore[arg-type]
            for f in FIELDS
        }


def _spawn(size: int) -> World:
    named = {c.name: (c, c.inputs(seed=i)) for i, c in enumerate(cases(size))}
    sub_case = RingCase("subgroup-zigzag-causal", 10, True, "zigzag", tile=2)
    subgroup = (sub_case, [sub_case.inputs(seed=100 + i) for i in range(size // 2)])
    payload = {"cases": list(named.values()), "fault_timeout": FAULT_TIMEOUT[size], "subgroup": subgroup}
    reports = run_world(world_suite, size, payload)
    if size > 2:
        # the last rank exits on purpose after its forward (see test_crashed_peer_...)
        assert not reports[-1].ok and reports[-1].exitcode == 3, reports[-1].error
        ranks = [*results(reports[:-1]), reports[-1].value]
    else:
        ranks = results(reports)
    return World(size, named, ranks, subgroup)


@pytest.fixture(scope="module")
def world2() -> World:
    return _spawn(2)


@pytest.fixture(scope="module")
def world4() -> World:
    return _spawn(4)


@pytest.fixture(params=["world2", "world4"], ids=["P2", "P4"])
def world(request: pytest.FixtureRequest) -> World:
    return request.getfixturevalue(request.param)


def _max_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_matches_single_process(world: World, name: str) -> None:
    case, arrays = world.cases[name]
    got = world.gathered(name)
    ref = reference(case, arrays)
    assert {r["cases"][name]["out_dtype"] for r in world.ranks} == {str(DTYPES[case.dtype])}
    if case.dtype == "float64":
        single = single_process(case, arrays, torch.float64)
        for f in FIELDS:
            assert got[f].shape == single[f].shape
            assert _max_err(got[f], single[f]) < 1e-10, f"{f}: ring vs qkv.attention"
            assert _max_err(got[f], ref[f]) < 1e-10, f"{f}: ring vs qkv.reference"
    else:
        # docs/design.md's rule: error against float64 at most 2x (forward) / 3x (gradients) that of a
        # naive implementation in the same dtype, plus a small floor.
        low = naive(case, arrays, DTYPES[case.dtype])
        for f in FIELDS:
            factor = 2.0 if f == "out" else 3.0
            bound = factor * _max_err(low[f], ref[f]) + FLOAT32_FLOOR
            assert _max_err(got[f], ref[f]) <= bound, f"{f}: ring error vs float64 above the naive bound {bound:.3g}"


def test_causal_work_per_rank(world: World) -> None:
    """Zigzag gives every rank the same causal work; contiguous gives rank r about 2r + 1 units."""
    L = world.cases["zigzag-causal-gqa-tiles"][0].L
    contiguous = [r["cases"]["contiguous-causal-gqa-tiles"]["stats"].visited_pairs for r in world.ranks]
    zigzag = [r["cases"]["zigzag-causal-gqa-tiles"]["stats"].visited_pairs for r in world.ranks]
    total = L * (L + 1) // 2  # (query, key) pairs of a causal L x L matrix
    assert sum(contiguous) == sum(zigzag) == total
    assert len(set(zigzag)) == 1
    chunk = L // world.size
    assert contiguous == [chunk * r * chunk + chunk * (chunk + 1) // 2 for r in range(world.size)]
    skipped = [r["cases"]["contiguous-causal-gqa-tiles"]["stats"].chunk_pairs_skipped for r in world.ranks]
    assert skipped == [world.size - 1 - r for r in range(world.size)]  # blocks in the future never run


def test_subgroup_rings(world4: World) -> None:
    """Two rings of two ranks, {0, 1} and {2, 3}, inside the world of four (group ranks != global)."""
    world = world4
    case, arrays_by_pair = world.subgroup
    for pair, arrays in enumerate(arrays_by_pair):
        parts = [world.ranks[2 * pair + i]["subgroup"] for i in range(2)]
        single = single_process(case, arrays, torch.float64)
        for f in FIELDS:
            got = unshard([torch.from_numpy(p[f]) for p in parts], case.layout).numpy()  # type: ignore[arg-type]
            assert _max_err(got, single[f]) < 1e-10


def test_ranks_that_disagree_all_raise(world: World) -> None:
    for r in world.ranks:
        kind, message, _ = r["mismatch"]
        assert kind == "ValueError"
        assert "query heads H" in message and "rank 0: 4" in message and "rank 1: 2" in message


def test_shard_lengths_of_no_layout_are_rejected(world2: World) -> None:
    for r in world2.ranks:
        kind, message, _ = r["bad_lengths"]
        assert kind == "ValueError"
        assert "[4, 5]" in message and "[5, 4]" in message


def test_stalled_peer_raises_instead_of_hanging(world2: World) -> None:
    """The two-rank world ends with peers that stall (alive, silent)."""
    timeout = FAULT_TIMEOUT[2]
    for what, where in (("stalled_forward", "all_gather"), ("stalled_backward", "backward step 1")):
        kind, message, elapsed = world2.ranks[0][what]
        assert kind == "RingCommunicationError", (what, message)
        assert where in message and "rank 0 of 2" in message
        assert 0.8 * timeout <= elapsed <= timeout + 5.0


def test_crashed_peer_raises_instead_of_hanging(world4: World) -> None:
    """The four-rank world ends with its last rank exiting after the forward (exit code 3)."""
    for rank, r in enumerate(world4.ranks[:-1]):
        kind, message, elapsed = r["crashed"]
        assert kind == "RingCommunicationError", message
        assert f"rank {rank} of 4" in message
        assert elapsed <= FAULT_TIMEOUT[4] + 3.0
