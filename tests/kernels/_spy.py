"""A spy for the compiled kernels' entry points: counts the calls that returned a result
(None means the kernel was unavailable and the caller fell back), so a test fails if the
path it is about silently stops running."""

from __future__ import annotations

from types import ModuleType

import pytest


class CallSpy:
    """Wraps ``module.name`` for the test's duration; ``calls`` counts non-None results."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str) -> None:
        self.calls = 0
        real = getattr(module, name)

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            result = real(*args, **kwargs)
            self.calls += result is not None
            return result

        monkeypatch.setattr(module, name, counted)
