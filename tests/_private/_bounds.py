"""The version range qkv declares for a library (read from its installed metadata)."""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet


def declared_range(name: str) -> SpecifierSet:
    """qkv's specifier for ``name``, from its dependencies or its extras."""
    for line in metadata.requires("qkv") or []:
        requirement = Requirement(line)
        if requirement.name == name:
            return requirement.specifier
    raise LookupError(f"qkv declares no requirement on {name}")


def assert_checked_release_is_allowed(name: str, checked_with: str) -> None:
    """The release the private uses were checked against, and the installed one, lie inside
    qkv's range, and the range has an upper bound."""
    allowed = declared_range(name)
    assert any(spec.operator in ("<", "<=", "==", "~=") for spec in allowed), f"{name}{allowed} has no upper bound"
    assert allowed.contains(f"{checked_with}.0"), f"{name} {checked_with} is outside {allowed}"
    installed = metadata.version(name)
    assert allowed.contains(installed, prereleases=True), f"{name} {installed} is outside {allowed}"
