"""`qkv --help` stays fast: it imports neither PyTorch nor the benchmark package.

Python's ``-X importtime`` writes one stderr line per imported module ("import time: self |
cumulative | name"), so the modules a command imported can be read off its stderr."""

from __future__ import annotations

import subprocess
import sys


def test_help_imports_no_torch() -> None:
    command = [sys.executable, "-X", "importtime", "-m", "qkv", "--help"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode == 0, completed.stderr
    assert "bench" in completed.stdout and "inspect" in completed.stdout  # the help was printed
    imported = {line.rsplit("|", 1)[-1].strip() for line in completed.stderr.splitlines() if line.startswith("import time:")}
    assert "qkv.cli" in imported  # the listing works
    libraries = {"torch", "numpy", "matplotlib", "PIL", "transformers"}
    heavy = sorted(n for n in imported if n.split(".")[0] in libraries or n.startswith("qkv.bench"))
    assert heavy == []
