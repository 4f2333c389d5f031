"""Optional bridges between qkv and other libraries, imported only when used.

- `qkv.integrations.transformers`: qkv as an attention backend of Hugging Face transformers
  models (``register()``, then ``attn_implementation="qkv"``), and `Inspection` of any such
  model. Needs the ``qkv[transformers]`` extra.

Nothing here is imported by ``import qkv``.
"""
