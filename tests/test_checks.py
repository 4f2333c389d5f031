"""qkv._checks: the shared argument checks, against independent references."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from qkv._checks import broadcasts

_sizes = st.lists(st.integers(min_value=0, max_value=3), max_size=4)


@given(_sizes, _sizes)
def test_broadcasts_agrees_with_torch_where_the_result_keeps_the_target_shape(shape: list[int], target: list[int]) -> None:
    # a shape broadcasts *to* target when torch.broadcast_shapes accepts the pair and returns target
    try:
        expected = torch.broadcast_shapes(tuple(shape), tuple(target)) == torch.Size(target)
    except RuntimeError:
        expected = False
    assert broadcasts(tuple(shape), tuple(target)) == expected


def test_broadcasts_while_dynamo_traces_symbolic_sizes() -> None:
    # dynamic=True makes the sizes symbolic: the check must trace whole and answer as eager
    def check(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x + 1 if broadcasts(mask.shape, x.shape) else x - 1

    torch._dynamo.reset()
    try:
        compiled = torch.compile(check, backend="eager", dynamic=True, fullgraph=True)
        fits = compiled(torch.zeros(2, 3, 5, 5), torch.zeros(1, 5, 5))
        misfit = compiled(torch.zeros(2, 3, 6, 6), torch.zeros(2, 6, 6))
    finally:
        torch._dynamo.reset()
    assert fits.eq(1).all() and misfit.eq(-1).all()
