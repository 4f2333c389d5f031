"""qkv's published metadata, as the installed distribution reports it: an SPDX license
expression with its LICENSE file, the project's URLs and classifiers."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_license_expression_and_file() -> None:
    info = metadata.metadata("qkv")
    assert info["License-Expression"] == "MIT"
    assert info.get_all("License-File") == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").startswith("MIT License")


def test_urls_and_classifiers() -> None:
    info = metadata.metadata("qkv")
    urls = dict(entry.split(", ", 1) for entry in info.get_all("Project-URL") or [])
    assert {"Homepage", "Source", "Issues", "Design"} <= set(urls)
    assert urls["Design"].endswith("/docs/design.md")
    classifiers = info.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers and (ROOT / "src" / "qkv" / "py.typed").is_file()
    assert not any(c.startswith("License ::") for c in classifiers)  # PEP 639: the expression says it
