"""Fixtures of the viz tests (the Inspections themselves are built in `_inspections`)."""

from __future__ import annotations

import pytest
from tests.viz._inspections import HOSTILE, make_inspection

from qkv.inspect import Inspection


@pytest.fixture(scope="session")
def small() -> Inspection:
    """Eleven tokens with two multi-piece words and a hostile one."""
    return make_inspection(
        [["the"], ["tro", "##phy"], [HOSTILE], ["did"], ["not"], ["fit"], ["suit", "##case"]],
        layers=2,
        heads=3,
    )
