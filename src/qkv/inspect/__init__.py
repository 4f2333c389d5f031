"""`Inspection`: one text through a model, and what is read from it.

- `inspection`: the `Inspection` data type and `context_similarity`;
- `steps`: the seeds' four steps on one query row (`Projections`, `StepTrace`);
- `roles`: head roles after Clark et al. (2019); `rollout`: attention rollout;
- `pronoun`: where a pronoun looks in the Winograd trophy sentences.

The viewers (`qkv.viz`) draw an Inspection; nothing here imports them.
"""

from __future__ import annotations

from qkv.inspect.inspection import (
    HeadRoles,
    Inspection,
    Projections,
    StepTrace,
    context_similarity,
    word_groups,
)

__all__ = ["HeadRoles", "Inspection", "Projections", "StepTrace", "context_similarity", "word_groups"]
