"""Tokenizers behind one small interface.

For now: a byte-level BPE trained with the Hugging Face `tokenizers` library on the training split
(seconds on a few MB) and saved as a standard `tokenizer.json`. Byte-level means any UTF-8 text
encodes with no unknown tokens. Documents are wrapped in Llama 3's special tokens
<|begin_of_text|> ... <|end_of_text|>.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from llama_jax.files import atomic_path

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"


class Tokenizer:
    def __init__(self, hf: HFTokenizer):
        self.hf = hf
        self.bos_id = hf.token_to_id(BOS)
        self.eos_id = hf.token_to_id(EOS)
        if self.bos_id is None or self.eos_id is None:
            raise ValueError(f"tokenizer lacks the special tokens {BOS} / {EOS}")

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    @classmethod
    def load(cls, path: Path) -> "Tokenizer":
        return cls(HFTokenizer.from_file(str(path)))

    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int) -> "Tokenizer":
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[BOS, EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is unknown
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer)
        return cls(hf)

    def save(self, path: Path) -> None:
        with atomic_path(path) as tmp:
            self.hf.save(str(tmp))

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_documents(self, documents: list[str]) -> np.ndarray:
        """Documents -> one stream [BOS doc EOS BOS doc EOS ...] of token ids."""
        dtype = np.uint16 if self.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
        pieces = [
            np.asarray([self.bos_id, *enc.ids, self.eos_id], dtype=dtype)
            for enc in self.hf.encode_batch(documents, add_special_tokens=False)
        ]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype)

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)
