"""Every bad input raises the promised error, naming the numbers, before any kernel runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((_t(1, 2, 3, 4), _t(1, 2, 5, 6), _t(1, 2, 5, 4)), {}, ValueError, r"E=4.*E=6"),
        # key/value length mismatch: PyTorch's CPU kernel would read past memory here
        ((_t(1, 2, 3, 4), _t(1, 2, 5, 4), _t(1, 2, 6, 4)), {}, ValueError, r"S=5.*S=6"),
        ((_t(1, 6, 3, 4), _t(1, 4, 5, 4), _t(1, 4, 5, 4)), {}, ValueError, r"H=6.*G=4"),
        ((_t(1, 2, 3, 4), _t(1, 2, 5, 4), _t(1, 1, 5, 4)), {}, ValueError, r"heads"),
        ((_t(3, 4), _t(3, 4), _t(3, 4)), {}, ValueError, r"at least 3 dimensions"),
        ((_t(1, 2, 3, 4), _t(2, 5, 4), _t(2, 5, 4)), {}, ValueError, r"same rank"),
        ((_t(2, 2, 3, 4), _t(3, 2, 5, 4), _t(3, 2, 5, 4)), {}, ValueError, r"batch"),
        ((_t(1, 2, 3, 4), _t(1, 2, 5, 4), _t(1, 2, 5, 4)), {"mask": torch.ones(3, 4, dtype=torch.bool)}, ValueError, r"broadcast"),
        ((_t(1, 2, 3, 4), _t(1, 2, 5, 4), _t(1, 2, 5, 4)), {"mask": torch.ones(2, 2, 3, 5, dtype=torch.bool)}, ValueError, r"broadcast"),
        ((_t(1, 2, 3, 4), _t(1, 2, 5, 4), _t(1, 2, 5, 4)), {"mask": torch.ones(3, 5, dtype=torch.int64)}, TypeError, r"bool.*float"),
        ((_t(1, 2, 3, 4), _t(1, 2, 5, 4), _t(1, 2, 5, 4)), {"mask": np.ones((3, 5), dtype=bool)}, TypeError, r"ndarray"),
        ((_t(1, 2, 3, 4), _t(1, 2, 5, 4), _t(1, 2, 5, 4)), {"dropout": 1.0}, ValueError, r"dropout.*\[0, 1\)"),
        ((_t(1, 2, 3, 4), _t(1, 2, 5, 4), _t(1, 2, 5, 4)), {"dropout": -0.1}, ValueError, r"dropout"),
        ((_t(1, 2, 3, 4), _t(1, 2, 5, 4), _t(1, 2, 5, 4)), {"scale": float("nan")}, ValueError, r"scale"),
        ((_t(1, 2, 3, 4), _t(1, 2, 5, 4), _t(1, 2, 5, 4)), {"backend": "flash"}, ValueError, r"backend.*'flash'"),
        ((np.ones((1, 2, 3, 4)), _t(1, 2, 5, 4), _t(1, 2, 5, 4)), {}, TypeError, r"q must be a torch.Tensor"),
        ((_t(1, 2, 3, 4), _t(1, 2, 5, 4, dtype=torch.float64), _t(1, 2, 5, 4)), {}, TypeError, r"one dtype"),
        ((_t(1, 2, 3, 4), torch.ones(1, 2, 5, 4, dtype=torch.int64), _t(1, 2, 5, 4)), {}, TypeError, r"floating-point"),
    ],
)
def test_bad_input_raises_a_clear_error(args: tuple, kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        qkv.attention(*args, **kwargs)
    with pytest.raises(error, match=match):
        qkv.explain(*args, **kwargs)


def test_errors_come_before_any_kernel_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def kernel_must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("a kernel ran before validation")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", kernel_must_not_run)
    monkeypatch.setattr(torch, "matmul", kernel_must_not_run)
    with pytest.raises(ValueError, match="S=5"):
        qkv.attention(_t(1, 2, 3, 4), _t(1, 2, 5, 4), _t(1, 2, 6, 4))


def test_mask_objects_combine_only_with_masks() -> None:
    with pytest.raises(TypeError, match="dense"):
        qkv.masks.causal() & torch.ones(2, 2, dtype=torch.bool)  # type: ignore[operator]
    with pytest.raises(ValueError, match="align"):
        qkv.masks.causal(align="middle")  # type: ignore[arg-type]
