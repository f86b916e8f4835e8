"""The loader's host memory against the corpus size: a token store of N documents opened as `llama-jax train`
opens it, batches read from a late step, and the process's peak resident memory above what it held before.

    .venv/bin/python bench/loader_memory.py --documents 100000000 [--json OUT]
    .venv/bin/python bench/loader_memory.py --documents 10000000 --code /path/to/other/checkout   # another version

The store is synthetic: N documents whose lengths are drawn like a web corpus's (log-normal, median 400 tokens,
16 to 32,768), in units of work of a million documents each, with a small BPE tokenizer. Only the lengths shape
the packing plans, so the token files are sparse (all zeros, no disk blocks) and a 100M-document store takes a
few GB of index, not the 100+ GB of its tokens. It is built once into --store and reused.

The measurement runs in a fresh process (--code puts another checkout's llama_jax first on its path): its
resident memory (VmRSS) after the imports is the baseline; then open_data() on the store, with a new plan cache,
and --batches batches read from the middle of the second epoch by the loader's reader threads, as train reads
them. Reported: peak_rss_mib_above_baseline (VmHWM - baseline), and of what is resident at the end the
process's own memory (anon) and the pages of memory-mapped files (file: tokens read, indices, plans; the
kernel's page cache, shared by a host's processes and reclaimed under pressure), first_batch_s (opening the data
and the first batch: the packing plans of epochs 0 and 1 are computed there) and batches_per_s (the rest). The
last line printed is the JSON object of every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
UNIT_DOCUMENTS = 1_000_000
VAL_EVERY = 1000  # one validation document per thousand


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, required=True, help="documents in the synthetic store")
    parser.add_argument("--store", default="", help="where the store is built (default: a directory under /tmp)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=50, help="batches read after the first")
    parser.add_argument("--code", default=str(ROOT), help="the checkout whose llama_jax is measured")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    parser.add_argument("--measure", default="", help=argparse.SUPPRESS)  # the child process: the store to open
    args = parser.parse_args(argv)
    if args.documents < 2 * VAL_EVERY:
        parser.error(f"--documents must be at least {2 * VAL_EVERY}")
    return args


def synthetic_store(directory: Path, documents: int, seed: int = 0) -> Path:
    """A token store of `documents` documents with web-like lengths and sparse (all-zero) tokens; built once."""
    if (directory / "meta.json").is_file():
        return directory
    from llama_jax.data.tokenizer import train_bpe

    (directory / "shards").mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe(["the quick brown fox jumps over the lazy dog"] * 64, 300).save(directory)
    rng = np.random.default_rng(seed)
    totals = {"train": [0, 0], "val": [0, 0]}  # documents, tokens
    units = math.ceil(documents / UNIT_DOCUMENTS)
    for unit in range(units):
        n = min(UNIT_DOCUMENTS, documents - unit * UNIT_DOCUMENTS)
        lengths = np.clip(rng.lognormal(np.log(400), 1.0, n), 16, 32768).astype(np.int64)
        val = np.zeros(n, bool)
        val[::VAL_EVERY] = True
        for split, mine in (("train", lengths[~val]), ("val", lengths[val])):
            bounds = np.concatenate([[0], np.cumsum(mine)]).astype(np.int64)
            np.save(directory / "shards" / f"{unit:05d}.{split}.idx.npy", bounds)
            with open(directory / "shards" / f"{unit:05d}.{split}.bin", "wb") as f:
                f.truncate(int(bounds[-1]) * 2)  # uint16 tokens, sparse: zeros without disk blocks
            totals[split][0] += len(mine)
            totals[split][1] += int(bounds[-1])
    tokens = {s: totals[s][1] for s in totals}
    meta = {
        "format": 1,
        "fingerprint": f"synthetic-{documents}-{seed}",
        "identity": {"synthetic": documents},
        "tokenizer": {**tokenizer_fingerprint(tokenizer), "file": tokenizer.name},
        "dtype": "uint16",
        "documents": {s: totals[s][0] for s in totals},
        "tokens": tokens,
        "bytes": 0,
        "bad_records": 0,
        "bad_examples": [],
        "units": units,
        "sources": [
            {
                "input": "synthetic",
                "weight": None,
                "units": list(range(units)),
                "documents": {s: totals[s][0] for s in totals},
                "tokens": tokens,
            }
        ],
    }
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def tokenizer_fingerprint(path: Path) -> dict:
    from llama_jax.data.tokenizer import load_tokenizer

    return load_tokenizer(path).fingerprint()


def rss_kib(field: str) -> int:
    """VmRSS (resident now), VmHWM (the peak so far), RssAnon or RssFile of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(args: argparse.Namespace) -> dict:
    """In the child process: open the store as train does and read batches from a late step."""
    from llama_jax.config import load_config
    from llama_jax.data.streams import open_data

    baseline, anon, files = rss_kib("VmRSS"), rss_kib("RssAnon"), rss_kib("RssFile")
    cache = tempfile.mkdtemp(prefix="llama-jax-plans-")  # a new plan cache: the plans are computed in this run
    config = load_config(
        "tiny",
        [
            f"data.sources=[{args.measure}]",
            f"data.cache_dir={cache}",
            "model.vocab_size=512",
            f"train.seq_len={args.seq_len}",
            f"train.batch_size={args.batch_size}",
            f"model.max_seq_len={args.seq_len}",
        ],
    )
    start = time.perf_counter()
    data = open_data(config, print_fn=lambda _: None)
    rows_per_epoch = data.train.components[0].rows_in_epoch(0)
    late = (rows_per_epoch + data.train.components[0].rows_in_epoch(1) // 2) // args.batch_size  # mid epoch 1
    batches = data.train.iterate(late, late + args.batches + 1, None, config.data.loader_threads, config.data.prefetch)
    next(batches)
    first_batch_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.batches):
        next(batches)
    return {
        "documents": args.documents,
        "peak_rss_mib_above_baseline": (rss_kib("VmHWM") - baseline) / 1024,
        # of what is resident at the end: the process's own memory, and pages of memory-mapped files (tokens,
        # indices, plans: the kernel's page cache, shared by the processes of a host and reclaimable)
        "anon_mib_above_baseline": (rss_kib("RssAnon") - anon) / 1024,
        "file_mib_above_baseline": (rss_kib("RssFile") - files) / 1024,
        "baseline_rss_mib": baseline / 1024,
        "first_batch_s": first_batch_s,
        "batches_per_s": args.batches / (time.perf_counter() - start),
        "late_step": late,
        "rows_per_epoch": rows_per_epoch,
        "code": args.code,
    }


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if args.measure:
        print(json.dumps(measure(args)))
        return 0
    store = Path(args.store or Path(tempfile.gettempdir()) / f"llama-jax-loader-memory-{args.documents}")
    started = time.perf_counter()
    synthetic_store(store, args.documents)
    print(f"store of {args.documents:,} documents at {store} ({time.perf_counter() - started:.0f}s)", flush=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([args.code, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "JAX_PLATFORMS": "cpu",
    }
    child = [
        sys.executable,
        __file__,
        "--documents",
        str(args.documents),
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--batches",
        str(args.batches),
        "--code",
        args.code,
        "--measure",
        str(store),
    ]
    result = subprocess.run(child, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stderr, file=sys.stderr)
        return result.returncode
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    print(
        f"{figures['documents']:,} documents: peak {figures['peak_rss_mib_above_baseline']:,.0f} MiB above the "
        f"baseline (at the end: {figures['anon_mib_above_baseline']:,.0f} MiB own, "
        f"{figures['file_mib_above_baseline']:,.0f} MiB mapped files), first batch {figures['first_batch_s']:.1f}s, "
        f"{figures['batches_per_s']:.1f} batches/s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
