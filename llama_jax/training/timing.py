"""Timing train steps on random tokens: what `llama-jax tune` measures its candidates with, and bench/step.py and
bench/gpu_check.py their figures."""

from __future__ import annotations

import time

import jax
import numpy as np

from llama_jax.config import Config
from llama_jax.training.program import TrainProgram


def random_batch(config: Config) -> dict[str, np.ndarray]:
    """One global batch of random tokens, one document per row: what timing a step needs."""
    b, t, v = config.train.batch_size, config.train.seq_len, config.model.vocab_size
    rng, prompt = np.random.default_rng(0), config.peft.virtual_tokens
    tokens, loss_mask = rng.integers(0, v, (b, t), dtype=np.int32), np.ones((b, t), np.float32)
    tokens[:, :prompt], loss_mask[:, :prompt] = -1 - np.arange(prompt), 0.0  # a learned prompt's slots (loader.py)
    return {
        "tokens": tokens,
        "targets": rng.integers(0, v, (b, t), dtype=np.int32),
        "segment_ids": np.ones((b, t), np.int32),
        "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)),
        "loss_mask": loss_mask,
    }


def time_train_steps(program: TrainProgram, state, batch, steps: int, warmup: int) -> tuple[list[float], dict]:
    """Seconds of each of `steps` train steps on a placed batch, after `warmup` untimed ones, and the
    last step's metrics (within program.activate(); the state is donated step to step)."""
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        state, metrics = program.train_step(state, batch)
        jax.block_until_ready(metrics)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times, metrics
