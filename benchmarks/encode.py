"""Sentences per second of `qkv.models.Encoder.encode` against sentence-transformers.

Both embed the same 2,000 sentences of mixed length (5 to 120 tokens, [CLS] and [SEP]
included, uniform), batch size 32, on the CPU, in one process, in float32 and in bfloat16:
sentence-transformers with its model cast to bfloat16 (``model.to(torch.bfloat16)``), qkv
with ``load_encoder(dtype=torch.bfloat16)`` (bf16 matrix multiplies, float32 LayerNorms and
residual stream). qkv runs padded and packed (each batch as one sequence with a documents
mask, no padding). Min cosine is against qkv float32 and against sentence-transformers
float32.

How it is timed: each library's ``encode`` sorts the sentences by length and cuts them into
batches of 32 (sentence-transformers by characters, qkv by tokens). The benchmark forms the
same batches up front, groups them by GROUP (4 batches, 128 sentences: what one ``encode``
call gets, so that each library batches as it does on a long list, and qkv runs batches side
by side on its threads, `qkv.models.batches`), then encodes group i of every path, in an
order that rotates from group to group, and sums each path's times: one run over the 2,000
sentences per path, interleaved so that the load of a shared machine falls on all paths
alike. "qkv bfloat16 one by one" is qkv bf16 padded with its batches one after another
(``qkv.backends.disabled("batch_workers")``), each on all threads, as sentence-transformers runs them;
"qkv bfloat16 unfused" is qkv bf16 padded on eager ops where it fuses (``F.linear`` + bias,
GELU, residual add + LayerNorm + cast: `qkv.native.onednn_linear`, `qkv.native.add_norm_bf16`
switched off). Compare the ratios, not the
absolute rates. The CPU time of this process (all threads) is reported next to the wall
clock because it is steadier when other processes compete for the cores.

Work: about 21 MFLOP per token for the projections and feed-forward (2 x 10.6M weights in
6 layers of 4 * 384^2 + 2 * 384 * 1536), plus 4 * T * 384 per token and layer for the
attention over T tokens; tokens/s and GFLOP/s count real (unpadded) tokens, so padding is a
cost. "of matmul" is GFLOP/s over the matmul limit in the path's dtype (`qkv.bench.matmul_gflops`:
the best of 1024^2 and 2048^2 products), measured in the same run.

    uv run python benchmarks/encode.py            # 2,000 sentences
    uv run python benchmarks/encode.py --quick    # 200 sentences
    uv run python benchmarks/encode.py --dtypes float32   # one dtype only
    uv run python benchmarks/encode.py --threads 1        # one intra-op thread
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # sentence-transformers loads from the package, offline

import copy

import numpy as np
import qkv_minilm
import torch

import qkv
from qkv.bench import matmul_gflops, matmul_words
from qkv.models import Encoder, load_encoder

MIN_TOKENS, MAX_TOKENS = 5, 120  # per sentence, [CLS] and [SEP] included
BATCH = 32
GROUP = 4  # batches per timed encode call


def make_sentences(encoder: Encoder, n: int, seed: int = 0) -> list[str]:
    """n sentences of whole-word vocabulary tokens, lengths uniform in [MIN_TOKENS, MAX_TOKENS]."""
    vocab = [w for w in encoder.tokenizer._tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 2]
    vocab.sort()
    rng = random.Random(seed)
    sentences = []
    for _ in range(n):
        words = rng.randint(MIN_TOKENS, MAX_TOKENS) - 2
        sentences.append(" ".join(rng.choice(vocab) for _ in range(words)))
    return sentences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 sentences instead of 2,000")
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's, 2 here)")
    args = parser.parse_args()
    n = 200 if args.quick else 2000
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    encoder = load_encoder()
    st = SentenceTransformer(str(qkv_minilm.MODEL_DIR), device="cpu")
    encoders = {"float32": encoder, "bfloat16": load_encoder(dtype=torch.bfloat16)}
    sts = {"float32": st, "bfloat16": copy.deepcopy(st).to(torch.bfloat16)}
    sentences = make_sentences(encoder, n)
    lengths = encoder.tokenizer.lengths(sentences)
    assert min(lengths) >= MIN_TOKENS and max(lengths) <= MAX_TOKENS, (min(lengths), max(lengths))
    tokens = sum(lengths)
    # the batches each library's encode forms: qkv sorts by tokens, sentence-transformers by
    # characters (np.argsort of minus the text length, as in SentenceTransformer.encode)
    by_tokens = sorted(range(n), key=lambda i: -lengths[i])
    by_chars = np.argsort([-len(text) for text in sentences]).tolist()
    step = BATCH * GROUP
    groups = {
        "qkv": [[sentences[i] for i in by_tokens[s : s + step]] for s in range(0, n, step)],
        "sentence-transformers": [[sentences[i] for i in by_chars[s : s + step]] for s in range(0, n, step)],
    }

    # path -> (encode one batch, whose batches it gets); ST fp32 is always run: the baseline
    runs: dict[str, tuple[Callable[[list[str]], torch.Tensor], str]] = {}
    dtype_of: dict[str, str] = {}
    for dtype in dict.fromkeys(["float32", *args.dtypes]):
        model, ours = sts[dtype], encoders[dtype]
        runs[f"ST {dtype}"] = (lambda t, m=model: m.encode(t, batch_size=BATCH, convert_to_tensor=True), "sentence-transformers")
        if dtype in args.dtypes:
            runs[f"qkv {dtype} padded"] = (lambda t, e=ours: e.encode(t, batch_size=BATCH), "qkv")
            runs[f"qkv {dtype} packed"] = (lambda t, e=ours: e.encode(t, batch_size=BATCH, packed=True), "qkv")
            if dtype == "bfloat16":
                runs["qkv bfloat16 one by one"] = (lambda t, e=ours: _one_by_one(e, t), "qkv")
                runs["qkv bfloat16 unfused"] = (lambda t, e=ours: _unfused(e, t), "qkv")
        dtype_of |= {name: dtype for name in runs if name not in dtype_of}
    order = {"qkv": by_tokens, "sentence-transformers": by_chars}
    rates = {dtype: matmul_gflops(getattr(torch, dtype)) for dtype in dict.fromkeys(dtype_of.values())}
    # useful work: projections and feed-forward per token, attention within each sentence
    D, inner, layers = encoder.config.hidden_size, encoder.config.intermediate_size, encoder.config.num_hidden_layers
    flops = layers * sum(2 * t * (4 * D * D + 2 * D * inner) + 4 * t * t * D for t in lengths)

    load_before = os.getloadavg()
    for fn, kind in runs.values():  # warm-up: first calls allocate and pick kernels
        fn(groups[kind][0])
        fn(groups[kind][-1])

    names = list(runs)
    wall = dict.fromkeys(names, 0.0)
    cpu = dict.fromkeys(names, 0.0)
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for b in range(len(groups["qkv"])):
        for name in names[b % len(names) :] + names[: b % len(names)]:
            fn, kind = runs[name]
            w, c = time.perf_counter(), time.process_time()
            out = fn(groups[kind][b])
            wall[name] += time.perf_counter() - w
            cpu[name] += time.process_time() - c
            outputs[name].append(out.float().cpu())
    embeddings = {}
    for name, (_, kind) in runs.items():
        stacked = torch.cat(outputs[name])  # (n, D) in the batches' order
        embeddings[name] = torch.empty_like(stacked)
        embeddings[name][order[kind]] = stacked  # back to the sentences' order

    load_after = os.getloadavg()
    print(f"{n} sentences, {tokens} tokens ({MIN_TOKENS}..{MAX_TOKENS} per sentence), batch {BATCH}, {GROUP} per call, "
          f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}, {flops / 1e9:.0f} GFLOP of useful work")
    print(f"matmul rates ({matmul_words()}, same run): " + ", ".join(f"{d} {r:.0f} GFLOP/s" for d, r in rates.items()))
    print(f"load average (1, 5, 15 min): before {_load(load_before)}, after {_load(load_after)} "
          f"on {os.cpu_count()} cores")
    st32 = embeddings["ST float32"]
    qkv32 = embeddings.get("qkv float32 padded")
    print(f"{'path':<25}{'sent/s':>8}{'tokens/s':>10}{'GFLOP/s':>9}{'of matmul':>10}{'vs ST fp32':>11}"
          f"{'vs ST same':>11}{'(CPU time)':>11}{'cos vs ST32':>12}{'cos vs qkv32':>13}")
    for name in names:
        dtype = dtype_of[name]
        same = f"ST {dtype}"
        cos_st = torch.nn.functional.cosine_similarity(embeddings[name], st32, dim=1).min().item()
        cos_qkv = "" if qkv32 is None else f"{torch.nn.functional.cosine_similarity(embeddings[name], qkv32, dim=1).min().item():>13.6f}"
        gflops = flops / wall[name] / 1e9
        print(f"{name:<25}{n / wall[name]:>8.1f}{tokens / wall[name]:>10.0f}{gflops:>9.1f}{gflops / rates[dtype]:>10.1%}"
              f"{wall['ST float32'] / wall[name]:>10.2f}x{wall[same] / wall[name]:>10.2f}x{cpu[same] / cpu[name]:>10.2f}x"
              f"{cos_st:>12.6f}{cos_qkv}")
    if "bfloat16" in args.dtypes:
        _print_goals(wall, embeddings)


def _one_by_one(encoder: Encoder, texts: list[str]) -> torch.Tensor:
    """qkv's encode with its batches one after another, each on all threads."""
    with qkv.backends.disabled("batch_workers"):
        return encoder.encode(texts, batch_size=BATCH)


def _unfused(encoder: Encoder, texts: list[str]) -> torch.Tensor:
    """qkv's padded encode on eager PyTorch ops for the products and the residual add +
    LayerNorm (``F.linear``, ``F.gelu``, ``norm(x + y)``, the cast) instead of oneDNN's fused
    linear and the compiled add + norm kernel."""
    with qkv.backends.disabled("onednn_linear", "add_norm_bf16"):
        return encoder.encode(texts, batch_size=BATCH)


def _load(load: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


def _print_goals(wall: dict[str, float], embeddings: dict[str, torch.Tensor]) -> None:
    """Issue 15's encode goals: qkv bf16 >= 1.3x ST bf16 and >= 2.5x ST fp32 in sentences/s,
    min cosine >= 0.9999 against qkv fp32; and qkv fp32 against ST fp32 (no regression)."""
    cosine = lambda a, b: torch.nn.functional.cosine_similarity(embeddings[a], embeddings[b], dim=1).min().item()  # noqa: E731
    print("goals (speed ratios are sentences/s over the peer's, same run):")
    for layout in ("padded", "packed"):
        name = f"qkv bfloat16 {layout}"
        line = (f"  {name:<20} vs ST bf16 {wall['ST bfloat16'] / wall[name]:.2f}x (goal >= 1.3), "
                f"vs ST fp32 {wall['ST float32'] / wall[name]:.2f}x (goal >= 2.5)")
        if "qkv float32 padded" in embeddings:
            line += f", min cosine vs qkv fp32 {cosine(name, 'qkv float32 padded'):.6f} (goal >= 0.9999)"
        print(line)
    for layout in ("padded", "packed"):
        name = f"qkv float32 {layout}"
        if name in wall:
            print(f"  {name:<20} vs ST fp32 {wall['ST float32'] / wall[name]:.2f}x, "
                  f"min cosine vs ST fp32 {cosine(name, 'ST float32'):.6f}")


if __name__ == "__main__":
    main()
