"""`Inspection`: one text through a model, and what is read from it.

- `inspection`: the `Inspection` data type and `context_similarity`;
- `steps`: the seeds' four steps on one query row (`Projections`, `StepTrace`);
- `roles`: head roles after Clark et al. (2019); `rollout`: attention rollout;
- `pronoun`: where a pronoun looks in the Winograd trophy sentences.

The viewers (`qkv.viz`) draw an Inspection; nothing here imports them. Names are resolved
lazily: the CLI reads the pronoun sentences without importing PyTorch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["HeadRoles", "Inspection", "Projections", "StepTrace", "context_similarity", "word_groups"]

if TYPE_CHECKING:
    from qkv.inspect.inspection import (
        HeadRoles,
        Inspection,
        Projections,
        StepTrace,
        context_similarity,
        word_groups,
    )


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module("qkv.inspect.inspection"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'qkv.inspect' has no attribute {name!r}")
