"""The pipeline of one attention call: validate the problem, choose the Plan, execute it, explain it.

- `problem`: the inputs checked once, before any kernel runs (`Problem`);
- `dispatch`: `choose_path` -> `Plan`, the one place where the path and its kernels are decided;
- `execute`: runs what a Plan names; `explain`: describes a Plan, counts its work and memory;
- `nan_rule`: the one rule for non-finite inputs; `bounds`: what a KV cache knows of its keys;
- `functional`: `qkv.attention`, `qkv.explain`, `qkv.attention_weights`; `varlen`: packed sequences.

`qkv.attention` itself is the function (`functional.attention`); this package is reached by its
submodules (``from qkv.attention.dispatch import choose_path``).
"""
