"""`Inspection.head_roles` on a six-token Inspection whose three heads are built by hand to be a
previous-token head, a [CLS] head and a broad (uniform) head; expected shares counted here."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.inspect import HeadRoles, Inspection
from qkv.inspect.roles import ROLES

TOKENS = ["[CLS]", "a", ",", "b", ".", "[SEP]"]  # text "a, b."


def _inspection() -> Inspection:
    T = 6
    previous = torch.zeros(T, T)
    previous[0, 0] = 1.0
    for i in range(1, T):
        previous[i, i - 1] = 1.0
    cls = torch.zeros(T, T)
    cls[:, 0] = 1.0
    broad = torch.full((T, T), 1 / T)
    attentions = torch.stack([previous, cls, broad])[None]  # (layers=1, heads=3, T, T)
    return Inspection(
        text="a, b.",
        tokens=TOKENS,
        offsets=[(0, 0), (0, 1), (1, 2), (3, 4), (4, 5), (0, 0)],
        word_ids=[None, 0, 1, 2, 3, None],
        attentions=attentions,
        hidden_states=torch.zeros(2, T, 4),
    )


def shares(roles: HeadRoles, head: int) -> dict[str, float]:
    return {role: float(roles.shares[0, head, r]) for r, role in enumerate(ROLES)}


def test_previous_token_head() -> None:
    # Queries 2..5 look at the token before (4 of 6 rows); query 1's previous token is [CLS]
    # and query 0 looks at itself, which is [CLS] too: special tokens count first.
    got = shares(_inspection().head_roles(), 0)
    assert got == pytest.approx({"previous": 4 / 6, "next": 0, "self": 0, "cls": 2 / 6, "sep": 0, "punctuation": 0, "rest": 0})


def test_cls_head() -> None:
    got = shares(_inspection().head_roles(), 1)
    assert got == pytest.approx({"previous": 0, "next": 0, "self": 0, "cls": 1, "sep": 0, "punctuation": 0, "rest": 0})


def test_broad_head() -> None:
    # Each of the 36 (query, key) pairs carries 1/36 of the total row mass (6 rows of 1).
    # cls: key 0, 6 pairs; sep: key 5, 6 pairs; self: queries 1..4, 4 pairs; previous: keys
    # 1..4 before queries 2..5, 4 pairs; next: 4 pairs; punctuation: "," (key 2) for queries
    # 0, 4, 5 and "." (key 4) for queries 0, 1, 2, 6 pairs; rest: "a" for queries 3, 4, 5
    # and "b" for queries 0, 1, 5, 6 pairs.
    roles = _inspection().head_roles()
    got = shares(roles, 2)
    expected = {"previous": 4, "next": 4, "self": 4, "cls": 6, "sep": 6, "punctuation": 6, "rest": 6}
    assert got == pytest.approx({role: n / 36 for role, n in expected.items()})
    assert float(roles.entropy[0, 2]) == pytest.approx(math.log(6))
    assert roles.entropy[0, :2].tolist() == [0.0, 0.0]  # one key per row


def test_summaries_and_records() -> None:
    roles = _inspection().head_roles()
    assert roles.strongest("previous") == (0, 0, pytest.approx(4 / 6))
    assert roles.strongest("cls") == (0, 1, pytest.approx(1.0))
    assert [ROLES[i] for i in roles.dominant()[0].tolist()] == ["previous", "cls", "cls"]  # ties: first role
    records = roles.records()
    assert [(r["layer"], r["head"]) for r in records] == [(0, 0), (0, 1), (0, 2)]
    assert set(records[0]) == {"layer", "head", *ROLES, "entropy", "dominant"}
    assert sum(records[2][role] for role in ROLES) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="unknown role 'verb'"):
        roles.strongest("verb")


def test_mean_counts_each_text_once() -> None:
    one = _inspection().head_roles()
    other = HeadRoles(shares=torch.zeros_like(one.shares), entropy=torch.ones_like(one.entropy), texts=1)
    mean = HeadRoles.mean([one, other])
    torch.testing.assert_close(mean.shares, one.shares / 2)
    assert mean.texts == 2
    # An average of three texts weighs three times one text.
    three = HeadRoles(shares=one.shares, entropy=one.entropy, texts=3)
    torch.testing.assert_close(HeadRoles.mean([three, other]).shares, 0.75 * one.shares)
    with pytest.raises(ValueError, match="at least one"):
        HeadRoles.mean([])
