"""`WordPieceTokenizer`: a ``tokenizer.json`` read with the `tokenizers` library.

The file of all-MiniLM-L6-v2 switches on padding and truncation to 128 tokens; both are
switched off here, because the encoder pads each batch itself (to its longest text) and
decides about long texts itself (an error past the model's positions, or an explicit
``truncate=True``). Character offsets and word ids are kept for inspection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

__all__ = ["TokenizedText", "WordPieceTokenizer"]


@dataclass(frozen=True)
class TokenizedText:
    """One text as token ids, with [CLS] and [SEP] added.

    - ids: T token ids.
    - tokens: T token strings (``[CLS]``, ``it``, ``##s`` ...).
    - offsets: T (start, end) character spans into the text, (0, 0) for special tokens.
    - word_ids: T word indices, None for special tokens.
    """

    ids: list[int]
    tokens: list[str]
    offsets: list[tuple[int, int]]
    word_ids: list[int | None]

    def __len__(self) -> int:
        return len(self.ids)


class WordPieceTokenizer:
    """The tokenizer of a BERT checkpoint, without built-in padding or truncation."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tokenizer = tokenizer

    @classmethod
    def from_file(cls, path: str | Path) -> WordPieceTokenizer:
        """Read ``tokenizer.json``; errors name the file."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # the Rust side raises a bare Exception for any bad file
            raise ValueError(f"{path} is not a valid tokenizer.json: {error}") from None
        return cls(tokenizer)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str) -> TokenizedText:
        """Tokenize one text."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[TokenizedText]:
        """Tokenize many texts (in parallel inside `tokenizers`)."""
        _check_texts(texts)
        encodings = self._tokenizer.encode_batch(list(texts))
        return [
            TokenizedText(
                ids=list(e.ids),
                tokens=list(e.tokens),
                offsets=[(start, end) for start, end in e.offsets],
                word_ids=list(e.word_ids),
            )
            for e in encodings
        ]

    def ids_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids only, [CLS] and [SEP] included, of many texts: what sentence embeddings
        need. The same ids as `encode_batch` without building tokens, offsets and word ids
        in Python, which took a third of the tokenizing time."""
        _check_texts(texts)
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets, unused here
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return [e.ids for e in encode(list(texts))]

    def lengths(self, texts: Sequence[str]) -> list[int]:
        """Token counts (with [CLS] and [SEP]) of many texts."""
        return [len(ids) for ids in self.ids_batch(texts)]


def _check_texts(texts: Sequence[str]) -> None:
    """TypeError naming the first entry of ``texts`` that is not a str."""
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{index}] must be a str, got {type(text).__name__}")
