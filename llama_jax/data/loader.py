"""The simple data path: tokenize a corpus once into a cache, then cut packed batches from it.

Preparation: documents -> train/validation split by document -> byte-level BPE trained on the
train split -> one token stream per split, saved as .npy next to the tokenizer. A content hash names
the cache directory, so any later run on the same text reuses it and a changed corpus never does.

Batches: the train stream is cut into rows of seq_len + 1 tokens; each epoch visits the rows in a
permutation drawn from (seed, epoch). Batch i is therefore a pure function of (seed, i) and a resumed
run sees exactly the batches it would have seen. Rows hold several documents; segment ids and
positions restart at every <|begin_of_text|> so the model can keep documents apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from llama_jax.config import DataConfig
from llama_jax.files import atomic_path
from llama_jax.data.corpus import DataError, load_documents
from llama_jax.data.tokenizer import Tokenizer

FORMAT_VERSION = 1  # bump when the cache layout or the tokenizer recipe changes


def cache_root(data: DataConfig) -> Path:
    if data.cache_dir:
        return Path(data.cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llama_jax"


@dataclass(frozen=True)
class PreparedCorpus:
    tokenizer: Tokenizer
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    directory: Path


def _digest(documents: list[str], data: DataConfig) -> str:
    h = hashlib.sha256(f"v{FORMAT_VERSION}/{data.val_every_nth_doc}".encode())
    for doc in documents:
        h.update(doc.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()[:16]


def _save_npy(path: Path, array: np.ndarray) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, array)


def _check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {vocab_size}; "
                        "raise model.vocab_size")


def prepare(data: DataConfig, vocab_size: int, log: Callable[[str], None] = print) -> PreparedCorpus:
    """Tokenize the corpus (or reuse the cache) and return both splits with their tokenizer."""
    documents = load_documents(data.corpus)
    name = "shakespeare" if data.corpus == "shakespeare" else re.sub(r"\W+", "_", Path(data.corpus).name)
    directory = cache_root(data) / f"{name}-{_digest(documents, data)}"
    tokenizer_path = directory / f"tokenizer-{vocab_size}.json"
    train_path, val_path = directory / f"train-{vocab_size}.npy", directory / f"val-{vocab_size}.npy"

    if not (tokenizer_path.exists() and train_path.exists() and val_path.exists()):
        start = time.perf_counter()
        directory.mkdir(parents=True, exist_ok=True)
        n = data.val_every_nth_doc
        val_docs = documents[n - 1::n]
        if not val_docs:
            raise DataError(f"data.corpus has {len(documents)} documents, too few to hold out every "
                            f"{n}th for validation; lower data.val_every_nth_doc to at most {len(documents)}")
        train_docs = [d for i, d in enumerate(documents) if i % n != n - 1]
        tokenizer = Tokenizer.train_bpe(train_docs, vocab_size)
        _check_vocab(tokenizer, vocab_size)  # before writing anything that looks complete
        _save_npy(train_path, tokenizer.encode_documents(train_docs))
        _save_npy(val_path, tokenizer.encode_documents(val_docs))
        tokenizer.save(tokenizer_path)  # written last: its presence marks a complete cache
        (directory / f"meta-{vocab_size}.json").write_text(json.dumps({
            "corpus": data.corpus, "documents": len(documents), "train_documents": len(train_docs),
            "val_documents": len(val_docs), "vocab_size": tokenizer.vocab_size, "format": FORMAT_VERSION,
        }, indent=2))
        log(f"prepared {len(documents)} documents ({len(train_docs)} train, {len(val_docs)} validation) "
            f"with a {tokenizer.vocab_size}-token BPE in {time.perf_counter() - start:.1f}s -> {directory}")

    tokenizer = Tokenizer.load(tokenizer_path)
    _check_vocab(tokenizer, vocab_size)
    return PreparedCorpus(tokenizer, np.load(train_path, mmap_mode="r"), np.load(val_path, mmap_mode="r"),
                          directory)


def pack_rows(rows: np.ndarray, bos_id: int) -> dict[str, np.ndarray]:
    """rows [batch, seq+1] of concatenated documents -> model inputs and targets [batch, seq].

    segment_ids number the documents within a row (a new one starts at every BOS), positions count
    from 0 inside each document, and loss_mask drops the one target per boundary that would ask the
    model to predict the next document's BOS from the previous document.
    """
    rows = rows.astype(np.int32)
    is_bos = rows == bos_id
    segment_ids = np.cumsum(is_bos, axis=1, dtype=np.int32) + 1
    index = np.broadcast_to(np.arange(rows.shape[1], dtype=np.int32), rows.shape)
    document_start = np.maximum.accumulate(np.where(is_bos, index, 0), axis=1)
    positions = index - document_start
    return {
        "tokens": rows[:, :-1],
        "targets": rows[:, 1:],
        "segment_ids": segment_ids[:, :-1],
        "positions": positions[:, :-1],
        "loss_mask": (segment_ids[:, :-1] == segment_ids[:, 1:]).astype(np.float32),
    }


class PackedBatches:
    """Batch i of a token stream, as a pure function of (seed, i)."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, bos_id: int, split: str):
        self.tokens, self.batch_size, self.seq_len, self.seed, self.bos_id = tokens, batch_size, seq_len, seed, bos_id
        self.n_rows = len(tokens) // (seq_len + 1)
        if self.n_rows < batch_size:
            raise DataError(
                f"the {split} split has {len(tokens)} tokens, fewer than one batch of {batch_size} x "
                f"{seq_len + 1}; lower train.batch_size or train.seq_len, or use a larger corpus"
            )
        self._epoch, self._order = -1, np.arange(0)

    def _row_order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:  # one permutation per epoch, drawn from (seed, epoch) alone
            self._epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)
        return self._order

    def batch(self, step: int) -> dict[str, np.ndarray]:
        length = self.seq_len + 1
        rows = []
        for i in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, position = divmod(i, self.n_rows)
            start = int(self._row_order(epoch)[position]) * length
            rows.append(self.tokens[start:start + length])
        return pack_rows(np.stack(rows), self.bos_id)
