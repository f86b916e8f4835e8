"""`llama-jax prepare`: text inputs -> a token store that the loader reads with no tokenizing.

A token store is a directory:

    meta.json                    written last: its presence means the store is complete
    tokenizer.json|.model        a copy of the tokenizer, so the store is self-contained
    shards/00007.train.bin       raw token ids (uint16 or uint32), memory-mapped by the loader
    shards/00007.train.idx.npy   int64 document boundaries into the .bin (n_documents + 1)
    shards/00007.val.*           the held-out documents of the same unit
    shards/00007.json            the unit's counts; written after its shards, it marks the unit done

Every input is planned into units (corpus.py); worker processes tokenize units in parallel and
append EOS (and BOS where the tokenizer has one) to every document. Every n-th document of a unit
is held out for validation. The fingerprint of the inputs (paths, sizes, modification times), the
options and the tokenizer decides what a re-run does: the same fingerprint and a complete store
is a no-op; an interrupted run with the same fingerprint resumes at the first unfinished unit.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from llama_jax.data.corpus import BadRecords, ReadOptions, Unit, input_identity, parse_input, plan_units, read_unit
from llama_jax.data.tokenizer import Tokenizer, load_tokenizer, train_bpe
from llama_jax.errors import DataError
from llama_jax.files import STORAGE_ERRNOS, atomic_path, describe_write_failure, storage_errno, unwritable

FORMAT = 1  # bump when the store layout changes
SPLITS = ("train", "val")
TEXT_UNITS = ("file", "paragraph", "line")
BAD_RECORD_ACTIONS = ("fail", "skip")


@dataclass(frozen=True)
class PrepareOptions:
    inputs: tuple[str, ...]  # each "path" or "path@weight" (see corpus.py)
    out: str
    tokenizer: str = ""  # a tokenizer file or directory; "" trains a byte-level BPE of train_vocab tokens
    train_vocab: int = 0
    read: ReadOptions = field(default_factory=ReadOptions)
    val_every_nth_doc: int = 20
    workers: int = 0  # tokenizing processes; 0 = one per CPU core
    tokenizer_sample_mb: int = 256  # text the BPE is trained on, at most
    replace_stale: bool = False  # a store of other inputs in `out` is rebuilt (the cache) instead of an error


def check_options(options: PrepareOptions) -> None:
    if not options.inputs:
        raise DataError("prepare needs at least one input: a file, directory, glob, hf:DIR or shakespeare")
    if bool(options.tokenizer) == (options.train_vocab > 0):
        raise DataError(
            "name a tokenizer (--tokenizer PATH) or train one (--train-tokenizer VOCAB), not both or neither"
        )
    if options.read.text_unit not in TEXT_UNITS:
        raise DataError(f"text unit '{options.read.text_unit}' is unknown; use one of {', '.join(TEXT_UNITS)}")
    if options.read.on_bad_record not in BAD_RECORD_ACTIONS:
        raise DataError(f"on_bad_record '{options.read.on_bad_record}' is unknown; use fail or skip")
    if options.val_every_nth_doc < 2:
        raise DataError("val_every_nth_doc must be >= 2 (every n-th document is held out for validation)")
    weights = [parse_input(spec)[1] for spec in options.inputs]
    if any(w is None for w in weights) and any(w is not None for w in weights):
        raise DataError("give a mixture weight (path@weight) to every input or to none")


def fingerprint(options: PrepareOptions) -> dict:
    """Everything the store's content depends on; a change means the store must be rebuilt."""
    inputs = []
    for spec in options.inputs:
        path, weight = parse_input(spec)
        inputs.append({"input": path, "weight": weight, "files": input_identity(path)})
    if options.tokenizer:
        tokenizer = {"sha256": load_tokenizer(options.tokenizer).fingerprint()["sha256"]}
    else:
        tokenizer = {"train_bpe": options.train_vocab, "sample_mb": options.tokenizer_sample_mb}
    return {
        "format": FORMAT,
        "inputs": inputs,
        "read": asdict(options.read),
        "tokenizer": tokenizer,
        "val_every_nth_doc": options.val_every_nth_doc,
    }


def _digest(value: dict) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _write_json(path: Path, value: dict) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(value, indent=1))


# --------------------------------------------------------------------------------------------
# One unit, in a worker process


def _split_documents(unit: Unit, options: ReadOptions, every: int, bad: BadRecords) -> Iterator[tuple[str, str]]:
    """(split, document) pairs: every n-th document of the unit is held out."""
    for j, document in enumerate(read_unit(unit, options, bad)):
        yield ("val" if j % every == every - 1 else "train"), document


def tokenize_unit(index: int, unit: Unit, tokenizer_path: str, options: ReadOptions, every: int, shards: Path) -> dict:
    """Tokenize one unit into its shard files; returns its counts (also written as the done marker)."""
    tokenizer = load_tokenizer(tokenizer_path)
    dtype = token_dtype(tokenizer.vocab_size)
    bad = BadRecords()
    pieces: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    text_bytes = 0
    batch: list[tuple[str, str]] = []

    def flush():
        for (split, _), ids in zip(batch, tokenizer.encode_batch([d for _, d in batch])):
            head = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
            pieces[split].append(np.asarray(head + ids + [tokenizer.eos_id], dtype))
        batch.clear()

    for split, document in _split_documents(unit, options, every, bad):
        text_bytes += len(document.encode("utf-8"))
        batch.append((split, document))
        if len(batch) == 512:
            flush()
    flush()
    stats = {"unit": index, "bytes": text_bytes, "bad_records": bad.count, "bad_examples": bad.examples}
    for split in SPLITS:
        lengths = np.array([len(p) for p in pieces[split]], np.int64)
        with atomic_path(shards / f"{index:05d}.{split}.bin") as tmp:
            (np.concatenate(pieces[split]) if pieces[split] else np.zeros(0, dtype)).tofile(tmp)
        with atomic_path(shards / f"{index:05d}.{split}.idx.npy") as tmp, open(tmp, "wb") as f:
            np.save(f, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        stats[split] = {"documents": len(lengths), "tokens": int(lengths.sum())}
    _write_json(shards / f"{index:05d}.json", stats)  # last: the unit is done
    return stats


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _quiet_worker() -> None:
    # One process per core already uses every core; the tokenizers library's own threads would
    # only oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"


# --------------------------------------------------------------------------------------------
# The whole store


def _units(options: PrepareOptions) -> list[tuple[int, Unit]]:
    """(source index, unit) for every input, in input order."""
    return [
        (source, unit)
        for source, spec in enumerate(options.inputs)
        for unit in plan_units(parse_input(spec)[0], options.read)
    ]


def _train_tokenizer(units: list[tuple[int, Unit]], options: PrepareOptions, directory: Path) -> Path:
    """Train the byte-level BPE on (a sample of) the training documents only."""
    budget = options.tokenizer_sample_mb << 20

    def texts():
        nonlocal budget
        for _, unit in units:
            for split, document in _split_documents(unit, options.read, options.val_every_nth_doc, BadRecords()):
                if split == "train":
                    budget -= len(document)
                    yield document
                if budget <= 0:
                    return

    return train_bpe(texts(), options.train_vocab).save(directory)


def _open_directory(out: Path, digest: str, replace_stale: bool, print_fn: Callable[[str], None]) -> bool:
    """Decide what to do with `out`: True if a complete store for these inputs is already there."""
    meta, marker = out / "meta.json", out / ".prepare.json"
    if meta.exists():
        if json.loads(meta.read_text()).get("fingerprint") == digest:
            return True
        if not replace_stale:
            raise DataError(
                f"{out} holds a token store prepared from other inputs or options; "
                "choose another output directory or delete it"
            )
        print_fn(f"the inputs of {out} changed since it was prepared; preparing it again")
        _write_json(marker, {"fingerprint": "stale"})  # from here on the store is incomplete
        meta.unlink()
    if marker.exists():
        if json.loads(marker.read_text()).get("fingerprint") == digest:
            done = len(list((out / "shards").glob("*.json")))
            print_fn(f"resuming the interrupted prepare in {out} ({done} unit(s) done)")
            return False
        print_fn(f"restarting the interrupted prepare in {out}: the inputs or options changed")
        shutil.rmtree(out / "shards", ignore_errors=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spm.model"):
            (out / name).unlink(missing_ok=True)
    elif out.exists() and any(out.iterdir()):
        raise DataError(f"{out} exists and is not a token store; choose a new or empty output directory")
    return False


def prepare(options: PrepareOptions, print_fn: Callable[[str], None] = print, progress: bool = True) -> Path:
    """Build (or resume, or confirm) the token store at options.out; returns its directory."""
    check_options(options)
    out = Path(options.out).expanduser()
    if problem := unwritable(out):
        raise DataError(
            f"the token store {out} cannot be written: {problem}; choose another output directory "
            "(--out, or data.cache_dir for the stores a run prepares)"
        )
    units = _units(options)  # checks every input before anything is written
    identity = fingerprint(options)
    digest = _digest(identity)
    if _open_directory(out, digest, options.replace_stale, print_fn):
        tokens = json.loads((out / "meta.json").read_text())["tokens"]["train"]
        print_fn(f"{out} is up to date ({tokens:,} training tokens)")
        return out
    created = not out.exists()
    try:
        return _build(options, out, units, identity, digest, print_fn, progress)
    except OSError as err:  # a full, read-only or failing disk: what is written stays, and a re-run resumes from it
        if storage_errno(err) not in STORAGE_ERRNOS:
            raise
        raise DataError(
            f"writing the token store {out} failed: {describe_write_failure(err, out)}; the units "
            "tokenized so far are kept: re-run the same command once there is room and it resumes"
        ) from None
    except DataError:
        if created:  # bad data found while tokenizing: leave nothing behind
            shutil.rmtree(out, ignore_errors=True)
        raise


def _build(
    options: PrepareOptions,
    out: Path,
    units,
    identity: dict,
    digest: str,
    print_fn: Callable[[str], None],
    progress: bool,
) -> Path:
    start = time.perf_counter()
    shards = out / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    _write_json(out / ".prepare.json", {"fingerprint": digest, "identity": identity})

    saved = [out / n for n in ("tokenizer.json", "tokenizer.model", "spm.model") if (out / n).exists()]
    if saved:
        tokenizer_path = saved[0]
    elif options.tokenizer:
        tokenizer_path = load_tokenizer(options.tokenizer).save(out)
    else:
        tokenizer_path = _train_tokenizer(units, options, out)
    tokenizer = load_tokenizer(tokenizer_path)

    todo = [i for i in range(len(units)) if not (shards / f"{i:05d}.json").exists()]
    _run_units(units, todo, str(tokenizer_path), options, shards, progress)
    stats = [json.loads((shards / f"{i:05d}.json").read_text()) for i in range(len(units))]
    meta = _metadata(options, identity, digest, units, stats, tokenizer, tokenizer_path)
    if meta["documents"]["train"] == 0 or meta["documents"]["val"] == 0:
        raise DataError(
            f"the inputs hold {sum(meta['documents'].values())} non-empty document(s), too few to hold "
            f"out every {options.val_every_nth_doc}th for validation and train on the rest; "
            "add documents or lower val_every_nth_doc"
        )
    _write_json(out / "meta.json", meta)  # last: the store is complete
    (out / ".prepare.json").unlink()
    seconds = time.perf_counter() - start
    megabytes = sum(s["bytes"] for s in stats) / 1e6
    bad = (
        f", skipped {meta['bad_records']} bad record(s) (e.g. {meta['bad_examples'][0]})" if meta["bad_records"] else ""
    )
    print_fn(
        f"prepared {sum(meta['documents'].values()):,} documents ({megabytes:.1f} MB, {meta['tokens']['train']:,} "
        f"train / {meta['tokens']['val']:,} val tokens) in {seconds:.1f}s ({megabytes / seconds:.1f} MB/s){bad} "
        f"-> {out}"
    )
    return out


def _run_units(
    units, todo: list[int], tokenizer_path: str, options: PrepareOptions, shards: Path, progress: bool
) -> None:
    workers = min(options.workers or os.cpu_count() or 1, len(todo))
    jobs = [(i, units[i][1], tokenizer_path, options.read, options.val_every_nth_doc, shards) for i in todo]
    bar = tqdm(total=len(jobs), unit="unit", desc="tokenizing", disable=not progress or not jobs)
    with bar:
        if workers <= 1:
            for job in jobs:
                tokenize_unit(*job)
                bar.update()
            return
        # spawn, not fork: the parent may hold JAX's or the tokenizers library's threads.
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_quiet_worker) as pool:
            for future in concurrent.futures.as_completed([pool.submit(tokenize_unit, *job) for job in jobs]):
                future.result()  # re-raises a worker's DataError here
                bar.update()


def _metadata(options, identity, digest, units, stats, tokenizer: Tokenizer, tokenizer_path: Path) -> dict:
    sources = []
    for source, spec in enumerate(options.inputs):
        path, weight = parse_input(spec)
        mine = [i for i, (s, _) in enumerate(units) if s == source]
        sources.append(
            {
                "input": path,
                "weight": weight,
                "units": mine,
                "documents": {s: sum(stats[i][s]["documents"] for i in mine) for s in SPLITS},
                "tokens": {s: sum(stats[i][s]["tokens"] for i in mine) for s in SPLITS},
            }
        )
    return {
        "format": FORMAT,
        "fingerprint": digest,
        "identity": identity,
        "tokenizer": {**tokenizer.fingerprint(), "file": tokenizer_path.name},
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "documents": {s: sum(x[s]["documents"] for x in stats) for s in SPLITS},
        "tokens": {s: sum(x[s]["tokens"] for x in stats) for s in SPLITS},
        "bytes": sum(x["bytes"] for x in stats),
        "bad_records": sum(x["bad_records"] for x in stats),
        "bad_examples": [e for x in stats for e in x["bad_examples"]][:5],
        "sources": sources,
        "units": len(units),
    }
