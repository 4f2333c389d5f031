"""qkv's native code: the C++ kernels, the one builder, and this machine's CPU tier.

- `machine`: the CPU tier from PyTorch's own queries and what it means for each dtype;
- `build`: compiles a kernel once on this machine (the C++ compiler directly, loaded with ctypes,
  each kernel an operator ``torch.ops.qkv.*``) and says why whenever one cannot run;
- `switches`: the names that `qkv.backends.disabled` switches off, read by the kernels here;
- `inventory`: every kernel, what this machine says of it, and building them ahead of time;
- one module per kernel, next to its ``.cpp`` source: `interval_bf16`, `interval_bf16_backward`
  (built for amx and for avx512 with AVX-512 BF16: ``products_bf16.h``), `short_bf16`,
  `add_norm_bf16`; built per CPU tier: `decode`, `magnitude`, `short_wide`; `onednn_linear`
  (oneDNN's fused linear).
"""
