"""The CPU block engine: attention over only the tiles that a structured mask leaves visible.

`planner` lists the kernel calls that cover the visible scores, `calls` runs them and merges
partial rows, `engine` computes calls with PyTorch's CPU flash kernel, `scored` with score terms
(bias, softcap, score_mod), `matmul_backward` is the bfloat16 backward from matrix products.
"""
