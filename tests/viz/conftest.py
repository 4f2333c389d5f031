"""Fixtures of the viz tests (the Inspections themselves are built in `_inspections`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, sync_playwright
from tests.viz._browser import CHROMIUM, CHROMIUM_ARGS
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


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing; install Debian's Chromium (apt-get install -y chromium, as "
            ".ci/run does). The browser tests must run, so they fail instead of skipping."
        )
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield launched
        launched.close()
