"""Modules and state for models: `MultiHeadAttention` (`multihead`), `KVCache` (`cache`),
`PagedKVCache` (`paged_cache`), positional encodings (`positional`) and `interop` with
PyTorch's `nn.MultiheadAttention`."""
