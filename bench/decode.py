"""Decoding speed: KV-cache generation next to re-running the whole sequence for every token, for a
preset's model (random weights: speed does not depend on them) on the current device, in one run.

    .venv/bin/python bench/decode.py [--preset bench] [--prompt 64] [--new 128] [--batch 1 8] [--json out.json]

Both generate greedily the same number of tokens after a warm-up call that compiles them; tokens/s
counts new tokens of all rows. Prefill time is included in both, as a user waits for it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes for the KV cache")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    import jax
    import numpy as np

    from llama_jax.config import load_config
    from llama_jax.inference.generate import GREEDY, Generator, generate_without_cache
    from llama_jax.model.llama import init_params

    cfg = load_config(args.preset).model
    cfg = cfg.__class__(**{**cfg.__dict__, "max_seq_len": max(cfg.max_seq_len, args.prompt + args.new)})
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    results = {
        "preset": args.preset,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "prompt": args.prompt,
        "new_tokens": args.new,
        "kv_cache": {},
    }

    def timed(fn) -> float:
        fn()  # compiles
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    for batch in args.batch:
        prompts = rng.integers(0, cfg.vocab_size, (batch, args.prompt)).tolist()
        generator = Generator(cfg, batch, args.prompt + args.new, GREEDY)
        seconds = timed(
            lambda generator=generator, prompts=prompts: generator(params, prompts, args.new, jax.random.key(0))
        )
        results["kv_cache"][batch] = batch * args.new / seconds
    prompt = rng.integers(0, cfg.vocab_size, args.prompt).tolist()
    seconds = timed(lambda: generate_without_cache(cfg, params, prompt, args.new, jax.random.key(0), GREEDY))
    results["without_cache"] = args.new / seconds

    print(
        f"{args.preset} ({cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}) on "
        f"{results['device']}, prompt {args.prompt} + {args.new} new tokens, greedy:"
    )
    print(f"  without a cache (batch 1): {results['without_cache']:8.1f} tokens/s")
    for batch, tokens_per_s in results["kv_cache"].items():
        print(
            f"  KV cache, batch {batch:<3}:       {tokens_per_s:8.1f} tokens/s"
            f"  ({tokens_per_s / results['without_cache']:.1f}x)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
