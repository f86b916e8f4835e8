"""Data pipeline throughput: `prepare` (MB/s of text) and the loader (tokens/s delivered), next to
what the training step of a preset consumes, all measured in this one process.

    .venv/bin/python bench/data.py [--preset bench] [--steps 3] [--batches 200] [--json out.json]

The text is the Python standard library's source (about 30 MB of real code, installed with every
Python), written as jsonl, one file per document; the tokenizer is a byte-level BPE of the preset's
vocabulary trained on it first (not timed as part of tokenizing).
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import tempfile
import time
from pathlib import Path


def stdlib_jsonl(directory: Path, limit_mb: float) -> tuple[Path, int]:
    """The standard library's .py files as jsonl documents; returns (path, bytes of text)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    path, total = directory / "stdlib.jsonl", 0
    with open(path, "w") as out:
        for f in files:
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            out.write(json.dumps({"text": text}) + "\n")
            total += len(text.encode())
            if total > limit_mb * 1e6:
                break
    return path, total


def bench_prepare(source: Path, text_bytes: int, vocab: int, work: Path) -> dict:
    from llama_jax.data.prepare import PrepareOptions, prepare
    from llama_jax.data.tokenizer import train_bpe

    texts = (json.loads(line)["text"] for line in open(source))
    tokenizer_path = train_bpe(texts, vocab).save(work / "bpe")
    results = {}
    for workers in (1, os.cpu_count() or 1):
        out = work / f"store-{workers}"
        start = time.perf_counter()
        prepare(
            PrepareOptions(inputs=(str(source),), out=str(out), tokenizer=str(tokenizer_path), workers=workers),
            print_fn=lambda _: None,
            progress=False,
        )
        seconds = time.perf_counter() - start
        results[f"prepare_mb_per_s_{workers}_workers"] = text_bytes / 1e6 / seconds
        start = time.perf_counter()  # a re-run on the same inputs must be a no-op
        prepare(
            PrepareOptions(inputs=(str(source),), out=str(out), tokenizer=str(tokenizer_path), workers=workers),
            print_fn=lambda _: None,
            progress=False,
        )
        results["prepare_rerun_s"] = time.perf_counter() - start
    results["store"] = str(out)
    return results


def bench_loader(config, batches: int) -> dict:
    from llama_jax.data.streams import open_data

    data = open_data(config, print_fn=lambda _: None)
    tokens = config.train.batch_size * config.train.seq_len
    results = {}
    for threads in (0, config.data.loader_threads):
        iterator = data.train.iterate(0, batches, threads=threads, prefetch=config.data.prefetch)
        next(iterator)  # the first epoch's packing plan is computed here, once per run
        start = time.perf_counter()
        for _ in range(batches - 1):
            next(iterator)
        results[f"loader_tokens_per_s_{threads}_threads"] = (batches - 1) * tokens / (time.perf_counter() - start)
    start = time.perf_counter()
    data.train.components[0].plan(1)
    results["plan_epoch_s"] = time.perf_counter() - start
    results["documents"] = len(data.train.components[0].documents.length)
    return results, data


def bench_step(config, data, steps: int) -> dict:
    import jax

    from llama_jax.training.batches import local_rows, put_batch
    from llama_jax.training.program import TrainProgram

    program = TrainProgram.for_config(config)
    with program.activate():
        state = program.init_state(jax.random.key(0))
        rows = local_rows(program)
        state, metrics = program.train_step(state, put_batch(program, data.train.batch(0, rows)))  # compiles
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for step in range(1, steps + 1):
            state, metrics = program.train_step(state, put_batch(program, data.train.batch(step, rows)))
        jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - start) / steps
    return {"step_s": seconds, "step_tokens_per_s": config.train.batch_size * config.train.seq_len / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps")
    parser.add_argument("--batches", type=int, default=200, help="batches drawn from the loader")
    parser.add_argument("--text-mb", type=float, default=30.0, help="standard-library text to prepare")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    import jax

    from llama_jax.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source, text_bytes = stdlib_jsonl(work, args.text_mb)
        base = load_config(args.preset)
        results = {
            "preset": args.preset,
            "text_mb": text_bytes / 1e6,
            "cpu_cores": os.cpu_count(),
            "jax": jax.__version__,
            "device": jax.devices()[0].device_kind,
        }
        results.update(bench_prepare(source, text_bytes, base.model.vocab_size, work))
        config = load_config(args.preset, [f"data.sources=[{results.pop('store')}]", f"data.cache_dir={work}"])
        loader, data = bench_loader(config, args.batches)
        results.update(loader)
        results.update(bench_step(config, data, args.steps))
    results["loader_over_step"] = (
        results[f"loader_tokens_per_s_{config.data.loader_threads}_threads"] / results["step_tokens_per_s"]
    )

    print(f"{'measure':<40} {'value':>14}")
    for key, value in results.items():
        print(f"{key:<40} {value:>14,.2f}" if isinstance(value, float) else f"{key:<40} {value!s:>14}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
