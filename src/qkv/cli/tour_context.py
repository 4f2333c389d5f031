"""How a section of `qkv tour` reports: one small type shared by the tour and its sections."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

__all__ = ["TourContext"]


@dataclass(frozen=True)
class TourContext:
    """How a section should report: ``out`` is None when nothing may be printed (--json)."""

    out: Console | None
    quiet: bool = False
    out_dir: Path = Path("qkv-out")  # where sections write their files
