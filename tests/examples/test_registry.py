"""The registry: names in the articles' order, lookups, and JSON for every result."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from qkv import examples
from qkv.examples import jsonable

ORDER = ["address-book", "agreement", "apple", "scaling", "permutation", "cross-attention", "multi-head", "quadratic", "context", "learned"]


def test_names_in_order() -> None:
    assert examples.names() == ORDER
    for name in ORDER:
        example = examples.get(name)
        assert example.name == name and example.title and example.summary


def test_unknown_name_lists_the_names() -> None:
    with pytest.raises(KeyError, match="address-book, agreement, apple"):
        examples.get("nope")  # the names, in order


def test_jsonable() -> None:
    assert jsonable({"a": np.array([[1.5, -np.inf]]), "b": (np.float64(2), np.int64(3), True, None)}) == {
        "a": [[1.5, "-inf"]],
        "b": [2.0, 3, True, None],
    }
    with pytest.raises(TypeError, match="object"):
        jsonable(object())


def test_lazy_export() -> None:
    import qkv

    assert qkv.examples is examples


@pytest.mark.parametrize("name", ["address-book", "agreement", "apple", "permutation", "cross-attention", "multi-head", "context"])
def test_json_round_trip(name: str) -> None:
    data = examples.get(name).run().to_json()
    assert json.loads(json.dumps(data, allow_nan=False)) == data


def test_numpy_examples_run_without_torch() -> None:
    # only agreement, quadratic and learned need PyTorch; the rest run on NumPy alone
    script = (
        "import sys\n"
        "from qkv import examples\n"
        "for name in examples.names():\n"
        "    if name not in ('agreement', 'quadratic', 'learned'):\n"
        "        examples.get(name).run().render()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode == 0, completed.stderr
