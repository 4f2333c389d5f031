"""`qkv.bench.fastest`, the one timing rule: rotating rounds, warm-up, the fastest run kept.

A fake clock makes every duration known in advance, so the expected values are hand counts."""

from __future__ import annotations

import pytest

from qkv.bench import fastest


class FakeClock:
    """A clock that each named function advances by its own fixed durations, in turn."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rounds_rotate_and_warm_up_first() -> None:
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    fastest(fns, repeats=3, warmup=2)
    warmup = ["a", "a", "b", "b", "c", "c"]
    rounds = ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert calls == [*warmup, *rounds]


def test_the_fastest_run_of_each_is_kept() -> None:
    clock = FakeClock()
    durations = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 6.0, 4.0])}

    def advance(name: str) -> None:
        clock.now += next(durations[name])

    fns = {name: (lambda name=name: advance(name)) for name in durations}
    assert fastest(fns, repeats=3, clock=clock) == {"a": 1.0, "b": 4.0}


def test_quick_calls_repeat_until_the_round_has_lasted() -> None:
    clock = FakeClock()
    count = {"quick": 0, "slow": 0}

    def quick() -> None:
        count["quick"] += 1
        clock.now += 0.25

    def slow() -> None:
        count["slow"] += 1
        clock.now += 2.0

    best = fastest({"quick": quick, "slow": slow}, repeats=2, round_seconds=1.0, clock=clock)
    assert count == {"quick": 8, "slow": 2}  # 4 calls of 0.25 s fill each 1-second round
    assert best == {"quick": 0.25, "slow": 2.0}


@pytest.mark.parametrize(("kwargs", "words"), [({"repeats": 0}, "repeats must be >= 1, got 0"),
                                               ({"repeats": 1, "warmup": -1}, "warmup must be >= 0, got -1")])
def test_bad_counts_are_refused(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        fastest({"a": lambda: None}, **kwargs)
