"""`qkv.distributed`: attention of sequences split across processes with torch.distributed.

- `ring_attention`: exact attention (causal or not, GQA, E != Ev) of a sequence whose shards
  live on the ranks of a process group (Liu et al. 2023, "Ring Attention"); differentiable.
- `shard`, `unshard`, `positions`: the contiguous and zigzag layouts (zigzag balances the
  causal work; Brandon et al. 2023, "Striped Attention").

Launch with ``torchrun --nproc-per-node P script.py`` and
``torch.distributed.init_process_group("gloo")`` (CPU) or ``"nccl"`` (GPU); see
``examples/ring.py``.
"""

from __future__ import annotations

from qkv.distributed.layout import LAYOUTS, Layout, positions, shard, shard_lengths, unshard
from qkv.distributed.ring import DEFAULT_TIMEOUT, RingCommunicationError, RingStats, ring_attention

__all__ = [
    "DEFAULT_TIMEOUT",
    "LAYOUTS",
    "Layout",
    "RingCommunicationError",
    "RingStats",
    "positions",
    "ring_attention",
    "shard",
    "shard_lengths",
    "unshard",
]
