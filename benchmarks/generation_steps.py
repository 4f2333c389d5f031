"""Where a greedy decoding step's time goes: qkv's transformers backend vs sdpa, attention against the rest.

    uv run python benchmarks/generation_steps.py [--context 8192 32768] [--steps 6] [--rounds 2]
        [--cache dynamic|static|growing] [--sdpa-cache dynamic|static|growing]

The model of `qkv.bench.generation` (random Llama-shaped, 4 layers, hidden 2,048, 32 / 8 heads
of 128, float32, one batch row), but its DynamicCache is filled with random keys and values of
``--context`` tokens directly, so that no prefill runs: a 32k context costs seconds, not the
minutes of a 32k prompt. Per step, from cProfile: the attention function (qkv's
``attention_forward`` or transformers' ``sdpa_attention_forward``), the cache's concatenation
(``torch.cat`` in ``DynamicLayer.update``, the same for both) and the linear layers (the same),
so that the end-to-end ratio can be read against what attention alone can change. The
implementations alternate ``--rounds`` times; the ratios come from the same round.

``--cache static``: a StaticCache sized for the context and the steps (what ``generate`` sizes
for a prompt and its new tokens) instead: it writes in place (no concatenation), and both
implementations get all its slots with a mask hiding the empty ones. ``--cache growing``:
`qkv.integrations.transformers.growing_cache`, a DynamicCache that appends in place (no
concatenation, only the filled rows). ``--sdpa-cache``: another cache for sdpa than for qkv
(default: the same), e.g. qkv on a growing cache against sdpa on transformers' default.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import statistics
import time

import torch
import transformers

from qkv.integrations.transformers import growing_cache, register

LAYERS, HIDDEN, HEADS, GROUPS, HEAD_DIM = 4, 2048, 32, 8, 128


def _model(context: int, steps: int) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM,
        max_position_embeddings=context + steps + 8,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _steps(model: transformers.PreTrainedModel, implementation: str, kv: list, steps: int, kind: str) -> dict[str, float]:
    """Milliseconds per step: total, attention function, cache concatenation, linear layers."""
    model.set_attn_implementation(implementation)
    context = kv[0][0].shape[2]
    caches = {
        "dynamic": lambda: transformers.DynamicCache(),
        "static": lambda: transformers.StaticCache(config=model.config, max_cache_len=context + steps + 2),
        "growing": lambda: growing_cache(),
    }
    cache = caches[kind]()
    for layer, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), layer)
    token = torch.tensor([[5]])  # (1, 1)
    with torch.inference_mode():
        for _ in range(2):  # warm-up; qkv's backend wraps the cache with running bounds on the second
            token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)  # (1, 1)
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        for _ in range(steps):
            token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)  # (1, 1)
        profile.disable()
        total = time.perf_counter() - start
    profile.create_stats()
    stats = profile.stats  # type: ignore[attr-defined]  # (file, line, name) -> (calls, calls, own, cumulative, callers)

    def cumulative(*names: str) -> float:
        return sum(row[3] for key, row in stats.items() if key[2] in names) / steps * 1e3

    return {
        "total": total / steps * 1e3,
        "attention": cumulative("attention_forward", "sdpa_attention_forward"),
        "cat": cumulative("<built-in method torch.cat>"),
        "linear": cumulative("<built-in method torch._C._nn.linear>"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache", choices=["dynamic", "static", "growing"], default="dynamic")
    parser.add_argument("--sdpa-cache", choices=["dynamic", "static", "growing"], default=None)
    args = parser.parse_args()
    kinds = {"sdpa": args.sdpa_cache or args.cache}
    name = register()
    print(f"load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for context in args.context:
        model = _model(context, args.steps)
        gen = torch.Generator().manual_seed(1)
        shape = (1, GROUPS, context, HEAD_DIM)  # (B, G, S, E)
        kv = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(LAYERS)]
        ratios, attention_ratios = [], []
        for round_ in range(args.rounds):
            rows = {impl: _steps(model, impl, kv, args.steps, kinds.get(impl, args.cache)) for impl in ("sdpa", name)}
            for impl, row in rows.items():
                print(
                    f"S={context:,} {kinds.get(impl, args.cache)} round {round_} {impl:5s}: {1e3 / row['total']:.3f} tok/s; ms per step: total "
                    f"{row['total']:.0f}, attention {row['attention']:.0f}, cache cat {row['cat']:.0f}, "
                    f"linear {row['linear']:.0f}"
                )
            ratios.append(rows["sdpa"]["total"] / rows[name]["total"])
            attention_ratios.append(rows["sdpa"]["attention"] / rows[name]["attention"])
        print(
            f"S={context:,} qkv on {args.cache}, sdpa on {kinds['sdpa']}: tokens/s qkv vs sdpa {statistics.median(ratios):.2f}x (rounds {[round(r, 2) for r in ratios]}); "
            f"attention function alone {statistics.median(attention_ratios):.2f}x"
        )
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
