"""The child process of the suite's peak-memory measurement (`qkv.bench.run_suite`).

    python -m qkv.bench._rss_child PATH WINDOW HEADS HEAD_DIM DTYPE N1 N2 ...

runs the sliding_window(WINDOW, WINDOW) forward for each n (increasing) on PATH "qkv"
(qkv.attention) or "sdpa" (SDPA with the dense bool mask), and prints one JSON line
``[n, peak RSS bytes so far]`` after each. A fresh process, so that its high-water mark is
its own (`qkv.bench.peak_rss_bytes`).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from qkv import masks
from qkv.attention.functional import attention
from qkv.bench._data import random_qkv
from qkv.bench._memory import peak_rss_bytes

PATHS = ("qkv", "sdpa")


def main(argv: list[str]) -> int:
    if len(argv) < 6 or argv[0] not in PATHS:
        print(f"usage: python -m qkv.bench._rss_child {{{','.join(PATHS)}}} WINDOW HEADS HEAD_DIM DTYPE N ...",
              file=sys.stderr)
        return 2
    path, window, heads, head_dim, dtype = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), getattr(torch, argv[4])
    mask = masks.sliding_window(window, window)
    for n in map(int, argv[5:]):
        q, k, v = random_qkv(n, heads=heads, head_dim=head_dim, dtype=dtype)
        with torch.no_grad():
            if path == "qkv":
                out = attention(q, k, v, mask)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to_dense(n, n))
        del q, k, v, out
        print(json.dumps([n, peak_rss_bytes()]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
