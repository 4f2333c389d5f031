"""The paths that compute attention; `qkv.attention.dispatch` picks one of them in one place.

- `dense`: PyTorch's SDPA and the explicit formula (math path);
- the CPU block engine (backend ``"blocks"``): `block_plan` plans, `block_calls` runs the call
  loop, `blocks` computes calls with PyTorch's CPU flash kernel, `scored` with score terms
  (bias, softcap, score_mod); `merge` merges partial softmaxes (also used by the ring);
- `flex`: FlexAttention with qkv's block layout, for CUDA, and on the CPU under torch.compile
  for a score_mod with a data mask without gradients (Inductor's CPU kernel);
- `protocol`: what every backend answers (`Backend`, `BACKENDS`) and the names of the kernels
  a Plan records; `disabled` (from `qkv.native.switches`) switches kernels and backends off.

Glossary of the block engine (from small to large):

- *tile*: one ``block_q x block_k`` block of a mask's block layout (`BlockLayout`), empty,
  partial or full; also the additive -inf bias that masks a partial piece.
- *piece*: a rectangle of the score matrix, query rows [q0, q1) x keys [k0, k1), computed in one
  pass, without a mask when every pair in it is visible (`block_plan.Piece`).
- *item*: one piece as the kernel sees it, one entry of the kernel's batch axis.
- *call*: one kernel invocation over ``items`` pieces of equal shape, whose queries and keys are
  strided views of the inputs (`block_plan.Call`); rows whose keys span several pieces are
  merged by log-sum-exp (`merge.merge_partial`).
"""

from qkv.native.switches import disabled

__all__ = ["disabled"]
