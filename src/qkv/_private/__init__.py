"""Every use of another library's private API, one module per library.

A private name (a leading underscore, or an internal module) can change in any release
without notice. Keeping each library's private uses in one module gives each of them one
place to read, one test (tests/_private/) that names the version it was checked against,
and one upper bound in pyproject.toml (tests/_private/test_private_uses.py keeps them here) that stops an untested release from being installed:

- `qkv._private.torch`: PyTorch's CPU flash-attention operators, oneDNN's fused linear, the
  softmax backward, the functorch / functionalization tensor checks, the torch-mode stacks
  and nn.Module's hook dictionaries (torch < 2.16).
- `qkv._private.typer`: the click exceptions that typer vendors (typer < 0.30).
- `qkv._private.transformers`: the attention and mask registries and the output collector of
  ``capture_outputs`` (transformers >= 5.2, < 6).

The modules are imported where they are used, never here: importing ``qkv._private`` imports
none of the three libraries.
"""
