"""Text sampling from a trained model.

This is the simple sampler the trainer uses for its end-of-run sample: every new token re-runs the
model over a fixed-size window (one compiled shape, so one compilation). It costs O(length²) and is
meant for short samples; KV-cache decoding for real inference lives with the inference tooling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.model import Llama


def sample_next(logits: jax.Array, rng: jax.Array, temperature: float, top_k: int) -> jax.Array:
    """logits [batch, vocab] -> token ids [batch]; temperature 0 means greedy."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits.astype(jnp.float32) / temperature
    if top_k > 0:
        kth_largest = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1)


def generate(model: Llama, params, prompt: list[int], max_new_tokens: int, rng: jax.Array,
             temperature: float = 0.8, top_k: int = 40, stop_token: int | None = None) -> list[int]:
    """Continue `prompt` by up to `max_new_tokens` tokens (fewer if `stop_token` is produced)."""
    window = min(model.cfg.max_seq_len, len(prompt) + max_new_tokens)
    prompt = prompt[-window:]

    @jax.jit
    def next_token(params, tokens, length, rng):
        logits = model.apply({"params": params}, tokens)  # causal: padding after `length` is never seen
        return sample_next(logits[:, length - 1], rng, temperature, top_k)

    tokens = np.zeros((1, window), np.int32)
    tokens[0, :len(prompt)] = prompt
    length, produced = len(prompt), []
    for _ in range(max_new_tokens):
        if length == window:  # slide the window left by one token
            tokens[0, :-1] = tokens[0, 1:]
            length -= 1
        rng, step_rng = jax.random.split(rng)
        token = int(next_token(params, jnp.asarray(tokens), length, step_rng)[0])
        if token == stop_token:
            break
        tokens[0, length] = token
        length += 1
        produced.append(token)
    return produced
