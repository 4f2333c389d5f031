"""`qkv --help` stays fast: it imports neither PyTorch nor the benchmark package; and qkv with
its tour's model needs none of the packages that a light install leaves out.

Python's ``-X importtime`` writes one stderr line per imported module ("import time: self |
cumulative | name"), so the modules a command imported can be read off its stderr."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


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


# The packages a light install (`pip install qkv`, `uv sync --no-dev`) does not have: qkv itself
# and `qkv tour` must run without them (docs/design.md, "Install"). transformers stays an
# optional extra, sentence-transformers a test reference.
ABSENT_FROM_LIGHT_INSTALL = ("transformers", "sentence_transformers", "sklearn", "scipy")

_CHECK_MODULES = """
import json, sys
heavy = {heavy!r}
def loaded():
    return sorted(name for name in sys.modules if name.split(".")[0] in heavy)
import qkv
after_import = loaded()
from qkv.cli.tour_model import SENTENCES
from qkv.models import load_encoder
encoder = load_encoder()
inspections = [encoder.inspect(s.text) for s in SENTENCES]
encoder.encode([s.text for s in SENTENCES])
print(json.dumps({{"import": after_import, "model": loaded(), "sentences": len(inspections)}}))
"""


def test_import_and_tour_model_load_need_no_heavy_packages() -> None:
    """`import qkv`, then the tour's model load (all-MiniLM-L6-v2 from qkv-minilm, inspected
    and encoded) in a fresh interpreter: none of the heavy packages enters sys.modules."""
    script = _CHECK_MODULES.format(heavy=ABSENT_FROM_LIGHT_INSTALL)
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["sentences"] > 0
    assert report["import"] == []
    assert report["model"] == []


def _required_closure(distribution: str) -> set[str]:
    """Normalized names of every distribution that installing ``distribution`` (no extras)
    brings in on this machine, read from the installed metadata."""
    seen: set[str] = set()
    todo = [distribution]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def test_installing_qkv_brings_no_heavy_packages() -> None:
    """What `pip install qkv` would pull in, by qkv's own declared requirements: the model's
    files (qkv-minilm), but none of sentence-transformers, transformers, scikit-learn, SciPy."""
    closure = _required_closure("qkv")
    assert "qkv-minilm" in closure and "torch" in closure  # the walk reached the dependencies
    heavy = {"sentence-transformers", "transformers", "scikit-learn", "scipy"}
    assert sorted(closure & heavy) == []


def test_a_transformers_model_without_the_extra_names_it(tmp_path: Path) -> None:
    """Without transformers (blocked here as in a light install), a model directory that needs
    it is refused in one line that names the `transformers` extra."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}', encoding="utf-8")
    script = (
        "import sys; sys.modules['transformers'] = None\n"  # import transformers -> ImportError
        "from qkv.cli import main\n"
        f"sys.argv = ['qkv', 'inspect', 'hello', '--model', {str(tmp_path)!r}]\n"
        "main()\n"
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode == 2, completed.stderr
    assert "pip install 'qkv[transformers]'" in completed.stderr
    assert "Traceback" not in completed.stderr
