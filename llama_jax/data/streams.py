"""The trainer's view of the data: config -> token stores -> train and validation batches; and the
batches `llama-jax eval` scores.

Sources that are not yet token stores ("shakespeare", text/jsonl/parquet files, hf:DIR) are
prepared on first use into the cache (`data.cache_dir`), keyed by the input and the options, so a
later run reuses the store and a changed input file is prepared again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llama_jax.config import Config, DataConfig
from llama_jax.data.corpus import BadRecords, ReadOptions, plan_units, read_unit
from llama_jax.data.loader import (
    Batches,
    TokenStore,
    batches,
    components,
    document_batches,
    log_components,
    stream_fingerprint,
)
from llama_jax.data.prepare import PrepareOptions, prepare
from llama_jax.data.tokenizer import Tokenizer, check_vocab, load_tokenizer
from llama_jax.errors import DataError
from llama_jax.files import cache_root


def is_store(spec: str) -> bool:
    # os.path.exists: a directory this user may not read is not a store, and reading it as an input says why.
    path = Path(spec).expanduser()
    return path.is_dir() and (os.path.exists(path / "meta.json") or os.path.exists(path / ".prepare.json"))


def resolve_store(
    spec: str, data: DataConfig, vocab_size: int, tokenizer: str, print_fn: Callable[[str], None]
) -> TokenStore:
    """A token store for `spec`: the store itself, or the cached store prepared from the input with
    `tokenizer` (a file; "" trains a BPE of vocab_size tokens on it)."""
    if is_store(spec):
        return TokenStore(Path(spec).expanduser())
    options = PrepareOptions(
        inputs=(spec,),
        out="",
        tokenizer=tokenizer,
        train_vocab=0 if tokenizer else vocab_size,
        read=ReadOptions(data.text_field, data.text_unit, data.on_bad_record),
        val_every_nth_doc=data.val_every_nth_doc,
        replace_stale=True,
    )
    absolute = spec if spec == "shakespeare" or spec.startswith("hf:") else str(Path(spec).expanduser().absolute())
    key = json.dumps(
        [
            absolute,
            options.tokenizer and str(Path(options.tokenizer).absolute()),
            options.train_vocab,
            options.read.__dict__,
            options.val_every_nth_doc,
        ]
    )
    name = re.sub(r"\W+", "_", Path(spec.removeprefix("hf:")).name or "input")[:40]
    out = cache_root(data.cache_dir) / "stores" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    options = PrepareOptions(**{**options.__dict__, "out": str(out)})
    return TokenStore(prepare(options, print_fn=print_fn, progress=False))


def check_sources(data: DataConfig) -> None:
    """Data named, and a tokenizer for every source that is not yet a token store (DataError, one line)."""
    if not data.sources:
        raise DataError(
            "data.sources is empty: name the data to train on, e.g. data.sources=[STORE] with a token "
            "store made by `llama-jax prepare CORPUS --out STORE --tokenizer TOKENIZER` (a Llama 3 model: "
            "its tokenizer.model); see docs/data.md"
        )
    raw = [spec for spec in data.sources if not is_store(spec)]
    if raw and not data.tokenizer:
        raise DataError(
            f"{raw[0]} is not a token store and data.tokenizer is not set: prepare it with "
            f"`llama-jax prepare {raw[0]} --out STORE --tokenizer TOKENIZER` (a Llama 3 model: its "
            "tokenizer.model) and name STORE in data.sources, or set data.tokenizer=TOKENIZER"
        )


@dataclass(frozen=True)
class TrainData:
    tokenizer: Tokenizer
    train: Batches
    val: Batches
    fingerprint: str  # names the training batch stream; saved with checkpoints


def open_data(config: Config, print_fn: Callable[[str], None] = print, first_row: int = 0) -> TrainData:
    """The data of `config`, its training batches from row `first_row` of the mixture on (a later stage of a staged
    run: config/stages.py). Raises DataError (one line) on bad data; writes only to the cache."""
    data, t = config.data, config.train
    check_sources(data)
    # Every source must share one tokenizer: inputs are prepared with data.tokenizer or, for "bpe",
    # with the first source's tokenizer (trained on that source when it is an input, not a store).
    stores, tokenizer_file = [], "" if data.tokenizer == "bpe" else data.tokenizer
    for spec in data.sources:
        stores.append(resolve_store(spec, data, config.model.vocab_size, tokenizer_file, print_fn))
        tokenizer_file = tokenizer_file or str(stores[0].tokenizer_path)
    identities = {s.tokenizer_sha256: s for s in stores}
    if len(identities) > 1:
        a, b = list(identities.values())[:2]
        raise DataError(
            f"{a.directory} and {b.directory} were prepared with different tokenizers; "
            "prepare every source with the same tokenizer"
        )
    store = stores[0]
    if data.tokenizer not in ("bpe", ""):  # a file: the stores must have been prepared with it
        if load_tokenizer(data.tokenizer).fingerprint()["sha256"] != store.tokenizer_sha256:
            raise DataError(
                f"{store.directory} was prepared with another tokenizer than data.tokenizer "
                f"({data.tokenizer}); prepare it with that tokenizer or set data.tokenizer to "
                f"{store.tokenizer_path}"
            )
    tokenizer = load_tokenizer(store.tokenizer_path)
    check_vocab(tokenizer, config.model.vocab_size)
    parts = components(stores, list(data.weights))
    log_components(parts, print_fn)
    settings = dict(packing=data.packing, window=data.packing_window)
    if config.peft.virtual_tokens:  # room for the prompt in front of every document (loader.py)
        settings["prompt_tokens"] = config.peft.virtual_tokens
    plans = cache_root(data.cache_dir) / "plans"  # written once, memory-mapped by every process (plans.py)
    train = batches(parts, "train", t.batch_size, t.seq_len, config.seed, **settings, plans=plans, first_row=first_row)
    # Validation uses a fixed seed so every evaluation scores the same tokens.
    val = batches(parts, "val", t.batch_size, t.seq_len, 0, **settings, plans=plans)
    if first_row:
        settings["first_row"] = first_row
    fingerprint = stream_fingerprint(parts, seed=config.seed, batch_size=t.batch_size, seq_len=t.seq_len, **settings)
    return TrainData(tokenizer, train, val, fingerprint)


def evaluation_batches(
    data: str,
    tokenizer: Tokenizer,
    batch_size: int,
    seq_len: int,
    split: str = "val",
    model: str = "the model",
    prompt_tokens: int = 0,
    read: ReadOptions = ReadOptions(),
) -> Batches:
    """What `llama-jax eval` scores: a token store's `split` (made with `tokenizer`, the tokenizer of
    `model`), or text/jsonl files tokenized here, every document whole (`read`: data.text_field, text_unit and
    on_bad_record); with room for a learned prompt of prompt_tokens in front of every document."""
    if is_store(data):
        store = TokenStore(Path(data).expanduser())
        if store.tokenizer_sha256 != tokenizer.fingerprint()["sha256"]:
            raise DataError(
                f"{data} was prepared with another tokenizer than {model}'s; prepare it with "
                f"`llama-jax prepare ... --tokenizer` and that model's tokenizer"
            )
        return batches(components([store], []), split, batch_size, seq_len, 0, "concat", 1, prompt_tokens)
    options, bad = read, BadRecords()
    documents = [
        np.asarray(tokenizer.encode_document(text), np.int32)
        for unit in plan_units(data, options)
        for text in read_unit(unit, options, bad)
    ]
    return document_batches(documents, batch_size, seq_len, prompt_tokens)
