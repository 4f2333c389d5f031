"""A mask or bias as text plus a list of tensors, to cross a ``torch.library`` operator boundary.

A custom operator takes tensors and plain values only, so a `qkv.masks.Mask` or `qkv.bias.Bias`
reaches the block engine's operators (`qkv.backends.blocks.ops`) as a *spec*: a Python literal
naming the class and its constructor arguments, with each tensor replaced by ``'@'`` and
appended to a list passed beside it. ``sliding_window(256)`` is
``('sliding_window',256,0,'bottom-right')``; ``documents(ids)`` is ``('documents','@',None)``
with ``[ids]``.

`encode` runs inside traced code (torch.compile, torch.export), so it is plain Python that
Dynamo follows without a graph break: ``isinstance``, ``repr`` of ints, floats, strings, bools
and None, string joins, and each object's ``spec_fields()``; no json, no NumPy, no tensor
values. The parameters it reads are the ones Dynamo guards on, so a new window size is a new
graph, not a stale one. `decode` runs in the operator's eager implementation and uses
``ast.literal_eval``.

An object takes part by a method ``spec_fields() -> tuple | None``: its spec name, then its
constructor's positional arguments in order (plain values, tensors, nested objects or tuples
of them); None when it cannot be rebuilt from text (a `qkv.masks.predicate`'s function).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Sequence

import torch

__all__ = ["TENSOR", "decode", "encode"]

# stands for the next tensor of the list
TENSOR = "@"


def encode(value: object, tensors: list[torch.Tensor]) -> str | None:
    """``value`` (a plain value, a tensor, a tuple, or an object with ``spec_fields``) as a
    Python literal, its tensors appended to ``tensors`` in order; None when some object in it
    cannot be rebuilt from text."""
    if value is None or isinstance(value, (bool, float, str)):
        return repr(value)
    if isinstance(value, int):
        # an f-string, not repr: Dynamo has no repr for a size it traces as symbolic (a window or
        # lengths computed from q.shape under dynamic shapes); formatting makes it a constant,
        # guarded on, as a spec must be. For an int the two texts are the same
        return f"{value}"
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return repr(TENSOR)
    if isinstance(value, tuple):
        items = [encode(item, tensors) for item in value]
        if any(item is None for item in items):
            return None
        return "(" + "".join(f"{item}," for item in items) + ")"  # a trailing comma: (x,) is a tuple
    fields = getattr(value, "spec_fields", None)
    described = fields() if callable(fields) else None
    if not isinstance(described, tuple):
        return None
    inner = encode(described, tensors)
    return None if inner is None else f"('!',{inner})"  # '!' marks an object: (name, *arguments)


@functools.lru_cache(maxsize=64)
def _parsed(text: str) -> object:
    """``text`` parsed as a Python literal: an operator decodes the same few specs on every call,
    and parsing one costs more than building its objects."""
    return ast.literal_eval(text)


def decode(text: str, tensors: Sequence[torch.Tensor], classes: dict[str, Callable[..., object]]) -> object:
    """The value `encode` gave ``text`` for, rebuilt with ``tensors`` (in the same order) and the
    constructors ``classes`` (spec name -> class); ValueError on a name it does not know or a
    count of tensors that does not match."""
    remaining = list(tensors)

    def build(node: object) -> object:
        if node == TENSOR:
            if not remaining:
                raise ValueError(f"spec {text!r} names more tensors than the {len(tensors)} given")
            return remaining.pop(0)
        if isinstance(node, tuple):
            if len(node) == 2 and node[0] == "!" and isinstance(node[1], tuple):
                name, *arguments = node[1]
                if name not in classes:
                    raise ValueError(f"spec {text!r} names {name!r}, which is none of {sorted(classes)}")
                return classes[name](*(build(a) for a in arguments))
            return tuple(build(item) for item in node)
        return node

    result = build(_parsed(text))
    if remaining:
        raise ValueError(f"spec {text!r} names fewer tensors than the {len(tensors)} given")
    return result
