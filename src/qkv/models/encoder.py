"""`Encoder` and `load_encoder`: a pretrained sentence encoder on qkv's attention, offline.

    >>> import qkv
    >>> encoder = qkv.models.load_encoder()          # all-MiniLM-L6-v2, from its PyPI package
    >>> encoder.encode(["a cat", "a dog"]).shape
    torch.Size([2, 384])
    >>> inspection = encoder.inspect("The trophy did not fit into the suitcase because it was too big.")
    >>> tuple(inspection.attentions.shape)          # (layers, heads, T, T)
    (6, 12, 16, 16)

Sentence embeddings are computed the way sentence-transformers computes them for
all-MiniLM-L6-v2: run the encoder with a key-padding mask, average the last hidden states
over the real tokens (mean pooling), then divide by the L2 norm. One difference is on
purpose: sentence-transformers silently cuts texts at 256 tokens (``max_seq_length`` of
this model), `Encoder.encode` raises past the model's 512 positions unless
``truncate=True``; texts of 257 to 512 tokens are therefore encoded whole here.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from qkv._checks import positive_int
from qkv.inspect.inspection import Inspection, Projections, context_similarity
from qkv.models import batches
from qkv.models.bert import BertEncoder
from qkv.models.config import BertConfig
from qkv.models.tokenizer import TokenizedText, WordPieceTokenizer
from qkv.models.weights import PICKLE_SUFFIXES, check_checkpoint, load_bert_weights, refuse_pickle

__all__ = [
    "DEFAULT_MODEL",
    "Encoder",
    "TextTooLongError",
    "builtin_model_dir",
    "check_text",
    "load_encoder",
    "mean_pool",
    "refuse_surrogates",
    "resolve_model_dir",
]

DEFAULT_MODEL = "all-MiniLM-L6-v2"
# Names that mean the model shipped in the `qkv-minilm` package (docs/design.md, "Install").
_BUILTIN_NAMES = (DEFAULT_MODEL, "sentence-transformers/all-MiniLM-L6-v2")
MODEL_FILES = ("config.json", "tokenizer.json", "model.safetensors")
# The distribution that ships the built-in model's files, and its import name.
BUILTIN_DISTRIBUTION, _BUILTIN_MODULE = "qkv-minilm", "qkv_minilm"

# Called after each batch with (texts done, texts in all).
ProgressCallback = Callable[[int, int], None]


class TextTooLongError(ValueError):
    """Texts with more tokens than the model has positions, refused because ``truncate`` is off.

    ``count`` texts are too long; the first is text ``index`` (0-based) with ``tokens`` tokens,
    against ``limit`` positions ([CLS] and [SEP] included). The message names the library's
    ``truncate=True``; the CLI words it with its ``--truncate`` flag.
    """

    def __init__(self, *, count: int, index: int, tokens: int, limit: int) -> None:
        self.count, self.index, self.tokens, self.limit = count, index, tokens, limit
        super().__init__(
            f"{count} text(s) exceed the model's {limit} positions (text {index} has {tokens} "
            f"tokens); pass truncate=True to keep the first {limit}"
        )


def refuse_surrogates(text: str, name: str = "text") -> None:
    """ValueError when ``text`` holds a lone surrogate (U+D800-U+DFFF), which is no character:
    Python makes them from bytes that were not UTF-8 (``errors="surrogateescape"``, file names,
    command lines), and a tokenizer cannot encode them. The message shows where it is."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise ValueError(
            f"{name} {shown!r} holds a lone surrogate (U+{ord(text[error.start]):04X}) at character "
            f"{error.start}, which is not a Unicode character: the text was decoded from bytes that "
            "were not UTF-8; decode them with their real encoding first"
        ) from None


def check_text(text: object, name: str = "text") -> None:
    """One text to inspect: a str (TypeError), not blank, no lone surrogate (ValueError)."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"{name} is empty; give at least one word to inspect")
    refuse_surrogates(text, name)


def _texts_or_raise(texts: object) -> list[str]:
    """``texts`` as a list of str: one str, or a sequence of them; TypeError naming what it got."""
    if isinstance(texts, str):
        refuse_surrogates(texts)
        return [texts]
    if isinstance(texts, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"texts must be a str or a sequence of str, got {type(texts).__name__}; "
            "decode bytes first, e.g. data.decode('utf-8')"
        )
    if not isinstance(texts, Iterable) or isinstance(texts, Mapping):
        raise TypeError(f"texts must be a str or a sequence of str, got {type(texts).__name__}")
    listed = list(texts)
    for index, text in enumerate(listed):
        if not isinstance(text, str):
            raise TypeError(f"texts[{index}] must be a str, got {type(text).__name__}")
        refuse_surrogates(text, f"text {index}")
    return listed


def resolve_model_dir(name_or_path: str | Path) -> Path:
    """The directory holding config.json, tokenizer.json and model.safetensors.

    A built-in name ("all-MiniLM-L6-v2") resolves to the installed package's copy; anything
    else must be a directory with the three files. Raises FileNotFoundError or ValueError
    with the reason.
    """
    if isinstance(name_or_path, str) and name_or_path in _BUILTIN_NAMES:
        return builtin_model_dir()
    if not isinstance(name_or_path, (str, Path)):
        raise TypeError(f"a model is a name or a directory path, got {type(name_or_path).__name__}")
    path = Path(name_or_path)
    refuse_pickle(path)
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(name_or_path)!r} is neither a directory nor a built-in model "
            f"(built in: {', '.join(_BUILTIN_NAMES)})"
        )
    if not path.is_dir():
        raise ValueError(f"model path {path} is a file; pass the directory holding {', '.join(MODEL_FILES)}")
    missing = [name for name in MODEL_FILES if not (path / name).is_file()]
    if "model.safetensors" in missing:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            raise ValueError(
                f"{path} has only pickle weights ({', '.join(pickles)}); qkv loads only "
                "model.safetensors, because unpickling can run arbitrary code"
            )
    if missing:
        raise FileNotFoundError(f"model directory {path} lacks {', '.join(missing)}")
    return path


def builtin_model_dir() -> Path:
    """The directory of all-MiniLM-L6-v2's files inside the installed `qkv-minilm` package.

    Found with ``importlib.util.find_spec``, which reads the import path without running the
    package. Raises FileNotFoundError naming the package to install when it is absent, and the
    files that are missing when it is incomplete.
    """
    spec = importlib.util.find_spec(_BUILTIN_MODULE)
    locations = spec.submodule_search_locations if spec is not None else None
    if not locations:
        raise FileNotFoundError(
            f"the built-in model {DEFAULT_MODEL} comes from the package {BUILTIN_DISTRIBUTION}, "
            f"which is not installed: pip install {BUILTIN_DISTRIBUTION} (or pass a directory "
            f"holding {', '.join(MODEL_FILES)})"
        )
    directory = Path(locations[0]).resolve()
    missing = [name for name in MODEL_FILES if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the package {BUILTIN_DISTRIBUTION} at {directory} lacks {', '.join(missing)}; "
            f"reinstall it: pip install --force-reinstall {BUILTIN_DISTRIBUTION}"
        )
    return directory


# The dtypes `load_encoder` runs the matrix multiplies in.
ENCODER_DTYPES = (torch.float32, torch.bfloat16)


def load_encoder(
    name_or_path: str | Path = DEFAULT_MODEL,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Encoder:
    """Load a BERT-family sentence encoder: all-MiniLM-L6-v2 by default, or a directory with
    config.json, tokenizer.json and model.safetensors. Nothing is downloaded.

    ``dtype``: float32, or bfloat16 for the matrix multiplies (attention projections,
    attention itself, feed-forward) on the CPU's bf16 units; embeddings, LayerNorms and the
    residual stream stay float32 and `Encoder.encode` returns float32 either way
    (`BertEncoder.set_matmul_dtype`).
    """
    if dtype not in ENCODER_DTYPES:
        raise TypeError(
            f"dtype must be one of {', '.join(str(d) for d in ENCODER_DTYPES)}, got {dtype!r}"
        )
    directory = resolve_model_dir(name_or_path)
    config = BertConfig.from_json(directory / "config.json")
    tokenizer = WordPieceTokenizer.from_file(directory / "tokenizer.json")
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"{directory}: tokenizer.json has {tokenizer.vocab_size} tokens but the config only "
            f"{config.vocab_size} word embeddings"
        )
    # the file against the config first: a config of absurd sizes is refused before it allocates
    check_checkpoint(directory / "model.safetensors", config)
    model = BertEncoder(config)
    load_bert_weights(model, directory / "model.safetensors", config)
    model.set_matmul_dtype(dtype)
    model.eval()
    name = DEFAULT_MODEL if str(name_or_path) in _BUILTIN_NAMES else str(directory)
    return Encoder(model, tokenizer, name=name).to(device)


class Encoder:
    """A pretrained encoder with its tokenizer: sentence embeddings and inspection."""

    def __init__(self, model: BertEncoder, tokenizer: WordPieceTokenizer, *, name: str = "") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name

    @property
    def config(self) -> BertConfig:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.embeddings.word.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the matrix multiplies (`BertEncoder.matmul_dtype`)."""
        return self.model.matmul_dtype

    @property
    def max_tokens(self) -> int:
        """Longest text in tokens, [CLS] and [SEP] included."""
        return self.config.max_position_embeddings

    def to(self, device: str | torch.device) -> Encoder:
        """Move the model to ``device``; returns self."""
        self.model.to(device)
        return self

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Encoder({self.name!r}, layers={c.num_hidden_layers}, heads={c.num_attention_heads}, "
            f"D={c.hidden_size}, dtype={str(self.dtype).removeprefix('torch.')}, device={self.device})"
        )

    # -- tokenization -------------------------------------------------------------------------

    def tokenize(self, texts: Sequence[str], *, truncate: bool = False) -> list[TokenizedText]:
        """Tokenize and check lengths: past `max_tokens`, raise unless ``truncate`` (then keep the
        first tokens and the closing [SEP])."""
        texts = _texts_or_raise(texts)
        encoded = self.tokenizer.encode_batch(texts)
        keep = slice(0, self.max_tokens - 1)  # everything but the closing special token is cut
        for i in self._too_long([len(t) for t in encoded], truncate):
            t = encoded[i]
            encoded[i] = TokenizedText(
                ids=t.ids[keep] + t.ids[-1:],
                tokens=t.tokens[keep] + t.tokens[-1:],
                offsets=t.offsets[keep] + t.offsets[-1:],
                word_ids=t.word_ids[keep] + t.word_ids[-1:],
            )
        return encoded

    def token_ids(self, texts: Sequence[str], *, truncate: bool = False) -> list[list[int]]:
        """The ids of `tokenize`, checked and cut the same way, without tokens and offsets."""
        rows = self.tokenizer.ids_batch(_texts_or_raise(texts))
        keep = self.max_tokens - 1  # everything but the closing special token is cut
        for i in self._too_long([len(r) for r in rows], truncate):
            rows[i] = rows[i][:keep] + rows[i][-1:]
        return rows

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """How many tokens each text has, [CLS] and [SEP] included, before any cut."""
        return self.tokenizer.lengths(_texts_or_raise(texts))

    def _too_long(self, lengths: list[int], truncate: bool) -> list[int]:
        """Indices of the texts past `max_tokens`; TextTooLongError unless ``truncate``."""
        limit = self.max_tokens
        too_long = [i for i, n in enumerate(lengths) if n > limit]
        if too_long and not truncate:
            first = too_long[0]
            raise TextTooLongError(count=len(too_long), index=first, tokens=lengths[first], limit=limit)
        return too_long

    # -- sentence embeddings ------------------------------------------------------------------

    def encode(
        self,
        texts: str | Sequence[str],
        *,
        batch_size: int = 32,
        normalize: bool = True,
        truncate: bool = False,
        progress: bool | ProgressCallback = False,
        packed: bool = False,
    ) -> torch.Tensor:
        """Sentence embeddings (N, D) float32, as sentence-transformers computes them.

        Args:
            texts: N texts (a single str counts as N = 1).
            batch_size: texts per forward pass. Texts are sorted by token count first so that
                each batch pads little; the result is in the input order.
            normalize: divide each embedding by its L2 norm (all-MiniLM-L6-v2's last module).
            truncate: cut texts longer than the model's positions instead of raising.
            progress: True draws a rich progress bar on stderr; a callable is called with
                (texts done, texts in all) after each batch.
            packed: run each batch as ONE sequence without padding: the texts side by side,
                a ``qkv.masks.documents`` mask so that each text attends only to itself, and
                positions restarting at 0 in every text. Same result, no work on padding.

        Returns:
            (N, D) float32 on the model's device: mean of the last hidden states over the
            real tokens of each text, L2-normalized when ``normalize``.
        """
        texts = _texts_or_raise(texts)
        positive_int(batch_size, "batch_size")
        if not isinstance(packed, bool):
            raise TypeError(f"packed must be a bool, got {type(packed).__name__}")
        encoded = self.token_ids(texts, truncate=truncate)
        N, D = len(encoded), self.config.hidden_size
        order = sorted(range(N), key=lambda i: -len(encoded[i]))
        chunks = [order[start : start + batch_size] for start in range(0, N, batch_size)]

        def embed(i: int) -> torch.Tensor:
            rows = [encoded[j] for j in chunks[i]]
            return self._embed_packed(rows) if packed else self._embed_padded(rows)  # (B, D)

        # on several CPU threads whole batches run side by side, one thread each (models.batches)
        count = batches.workers(len(chunks), self.device)
        with _progress_reporter(progress, N) as report, torch.no_grad():
            out = torch.empty(N, D, dtype=torch.float32, device=self.device)  # (N, D)
            done = lambda i: report(min((i + 1) * batch_size, N))  # noqa: E731
            for chunk, embedded in zip(chunks, batches.run_batches(embed, len(chunks), count, done), strict=True):
                out[chunk] = embedded
        return F.normalize(out, p=2, dim=1) if normalize else out

    def _embed_padded(self, rows: list[list[int]]) -> torch.Tensor:
        """Mean-pooled last hidden states (B, D) of B texts, right-padded to the longest."""
        ids, valid = self._pad(rows)  # (B, L), (B, L)
        padded = any(len(r) != len(rows[0]) for r in rows)  # texts of one length need no mask
        hidden = self.model(ids, valid=valid if padded else None).last_hidden  # (B, L, D)
        return mean_pool(hidden.float(), valid)  # (B, D) float32, whatever the model's dtype

    def _embed_packed(self, rows: list[list[int]]) -> torch.Tensor:
        """Mean-pooled last hidden states (B, D) of B texts packed into one sequence of
        T = sum of their lengths, with a documents mask and per-text positions."""
        from qkv.masks import documents

        lengths = torch.tensor([len(r) for r in rows], device=self.device)  # (B,)
        ids = torch.tensor([[t for r in rows for t in r]], dtype=torch.int64, device=self.device)  # (1, T)
        doc = torch.repeat_interleave(torch.arange(len(rows), device=self.device), lengths)  # (T,)
        starts = torch.cumsum(lengths, 0) - lengths  # (B,) first position of each text
        positions = torch.arange(ids.shape[1], device=self.device) - starts[doc]  # (T,) 0.. per text
        hidden = self.model(ids, mask=documents(doc[None]), positions=positions[None]).last_hidden[0].float()  # (T, D)
        sums = torch.zeros(len(rows), hidden.shape[1], dtype=hidden.dtype, device=self.device)  # (B, D)
        sums.index_add_(0, doc, hidden)
        return sums / lengths[:, None].to(hidden.dtype)  # (B, D)

    def _pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad id lists with [PAD]: ids (B, L) int64 and valid (B, L) bool."""
        L = max(len(r) for r in rows)
        ids = torch.full((len(rows), L), self.config.pad_token_id, dtype=torch.int64)  # (B, L)
        valid = torch.zeros(len(rows), L, dtype=torch.bool)  # (B, L)
        for b, row in enumerate(rows):
            ids[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
            valid[b, : len(row)] = True
        return ids.to(self.device), valid.to(self.device)

    # -- inspection ---------------------------------------------------------------------------

    def inspect(self, text: str, *, truncate: bool = False) -> Inspection:
        """Run one text and keep everything: tokens, offsets, word ids, the exact attention
        probabilities (layers, H, T, T) and the hidden states (layers + 1, T, D)."""
        check_text(text)
        (tokenized,) = self.tokenize([text], truncate=truncate)
        ids = torch.tensor([tokenized.ids], dtype=torch.int64, device=self.device)  # (1, T)
        with torch.no_grad():
            output = self.model(ids, return_weights=True, return_hidden=True)
        attentions = torch.stack([w[0] for w in output.attentions])  # (layers, H, T, T)
        hidden_states = torch.stack([h[0] for h in output.hidden_states])  # (layers + 1, T, D)
        with torch.no_grad():
            projections = self._projections(output.hidden_states)
        return Inspection(
            text=text,
            tokens=tokenized.tokens,
            offsets=tokenized.offsets,
            word_ids=tokenized.word_ids,
            attentions=attentions.float().cpu(),
            hidden_states=hidden_states.float().cpu(),
            model_name=self.name,
            projections=projections,
        )

    def _projections(self, hidden_states: tuple[torch.Tensor, ...]) -> Projections:
        """Every layer's per-head q, k, v, recomputed from that layer's input (the hidden state
        before it) with the layer's own projection weights; what `Inspection.steps` reads."""
        qs, ks, vs = [], [], []
        for layer, x in zip(self.model.blocks, hidden_states, strict=False):  # x (1, T, D): layer's input
            attention = layer.attention
            cfg = attention.config
            T = x.shape[1]
            x = x.to(attention.q_proj.weight.dtype)  # the layer's matmul dtype (its input is cast as in forward)
            q = attention.q_proj(x[0]).view(T, cfg.num_heads, cfg.d_k).transpose(0, 1)  # (H, T, E)
            k = attention.k_proj(x[0]).view(T, cfg.num_kv_heads, cfg.d_k).transpose(0, 1)  # (G, T, E)
            v = attention.v_proj(x[0]).view(T, cfg.num_kv_heads, cfg.d_v).transpose(0, 1)  # (G, T, Ev)
            if attention.rope is not None:
                q, k = attention.rope(q[None], 0)[0], attention.rope(k[None], 0)[0]  # (H, T, E), (G, T, E)
            qs.append(q)
            ks.append(k)
            vs.append(v)
        stack = lambda xs: torch.stack(xs).float().cpu()  # noqa: E731  (layers, heads, T, width)
        d_k = self.model.blocks[0].attention.config.d_k
        return Projections(q=stack(qs), k=stack(ks), v=stack(vs), scale=1.0 / math.sqrt(d_k))  # qkv.attention's default scale

    def context(self, word: str, text_a: str, text_b: str) -> torch.Tensor:
        """Cosine similarity (layers + 1,) of ``word``'s vectors in two texts, layer by layer
        (index 0: the embeddings). See `qkv.inspect.context_similarity`."""
        return context_similarity(self.inspect(text_a), self.inspect(text_b), word)


def mean_pool(hidden: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of hidden (B, L, D) over the positions where valid (B, L) is True -> (B, D)."""
    weights = valid.unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
    total = (hidden * weights).sum(dim=1)  # (B, D)
    count = weights.sum(dim=1).clamp(min=1e-9)  # (B, 1); sentence-transformers' guard
    return total / count


@contextmanager
def _progress_reporter(progress: bool | ProgressCallback, total: int) -> Iterator[Callable[[int], None]]:
    """Yield report(done): it drives a rich bar on stderr, calls the user's callback, or does nothing."""
    if callable(progress):
        yield lambda done: progress(done, total)
        return
    if not progress:
        yield lambda done: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    with Progress(
        "encoding", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=Console(stderr=True), transient=True,
    ) as bar:
        task = bar.add_task("encode", total=total)
        yield lambda done: bar.update(task, completed=done)
