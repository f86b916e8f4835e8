"""Text generation: prefill the prompts once, then one jitted decode step per new token.

The key/value cache is preallocated for prompt + new tokens ([layers, batch, cache_len, kv_heads,
head_dim] per tensor, in the compute dtype) and carries the same logical axis names as the model's
keys and values, so under a mesh it is sharded like them. Prompts of different lengths share one
batch: each row is right-padded, and row r's token at position p goes to cache slot p, so padding is
overwritten before any query can see it.

`generate_without_cache` is the reference: it re-runs the whole window for every token (O(length²)),
and tests check that both produce the same greedy tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.config import Config, ModelConfig
from llama_jax.errors import ConfigError
from llama_jax.model import Llama


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8  # 0: greedy
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches p (1: all)

    def check(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got "
                              f"temperature {self.temperature}, top_k {self.top_k}, top_p {self.top_p}")


GREEDY = Sampling(temperature=0.0)


def sample_next(logits: jax.Array, rng: jax.Array, sampling: Sampling) -> jax.Array:
    """logits [batch, vocab] -> token ids [batch]."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k > 0:
        kth_largest = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    if sampling.top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probabilities = jax.nn.softmax(ordered, axis=-1)
        # The smallest logit still inside the nucleus: tokens before it have not yet reached top_p.
        inside = jnp.cumsum(probabilities, axis=-1) - probabilities < sampling.top_p
        threshold = jnp.min(jnp.where(inside, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1)


class Generator:
    """Compiled prefill and decode steps for one model, batch size and cache length."""

    def __init__(self, cfg: ModelConfig, batch: int, cache_len: int, sampling: Sampling = GREEDY):
        if cache_len > cfg.max_seq_len:
            raise ConfigError(f"prompt + new tokens = {cache_len} exceed model.max_seq_len {cfg.max_seq_len}; "
                              "generate fewer tokens or shorten the prompt")
        sampling.check()
        self.cfg, self.batch, self.cache_len, self.sampling = cfg, batch, cache_len, sampling
        self.model = Llama(cfg, decode=True)
        # Cache shapes from an abstract init; the cache starts as zeros (placed by jit's output sharding).
        shapes = jax.eval_shape(self.model.init, jax.random.key(0), jnp.zeros((batch, cache_len), jnp.int32))
        self._empty_cache = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"]))

        def step(params, cache, tokens, positions, last, rng):
            logits, updated = self.model.apply({"params": params, "cache": cache}, tokens, positions,
                                               mutable=["cache"])
            chosen = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]  # [batch, vocab]
            return sample_next(chosen, rng, self.sampling), updated["cache"]

        self._step = jax.jit(step, donate_argnums=(1,))

    def __call__(self, params, prompts: list[list[int]], max_new_tokens: int, rng: jax.Array,
                 stop_token: int | None = None) -> list[list[int]]:
        """The new tokens of each prompt: up to max_new_tokens, ending before stop_token if produced."""
        if len(prompts) != self.batch or any(not p for p in prompts):
            raise ConfigError(f"need {self.batch} non-empty prompt(s), got {[len(p) for p in prompts]}")
        lengths = np.array([len(p) for p in prompts], np.int32)
        if lengths.max() + max_new_tokens > self.cache_len:
            raise ConfigError(f"the longest prompt ({lengths.max()}) + {max_new_tokens} new tokens exceed the "
                              f"cache of {self.cache_len}")
        width = int(lengths.max())
        tokens = np.zeros((self.batch, width), np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, :len(prompt)] = prompt
        positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
        rng, step_rng = jax.random.split(rng)
        token, cache = self._step(params, self._empty_cache(), jnp.asarray(tokens), jnp.asarray(positions),
                                  jnp.asarray(lengths - 1), step_rng)
        produced = np.zeros((self.batch, max_new_tokens), np.int32)
        done = np.zeros(self.batch, bool)
        last = np.zeros(self.batch, np.int32)
        for i in range(max_new_tokens):
            produced[:, i] = np.asarray(token)
            if stop_token is not None:
                done |= produced[:, i] == stop_token
            if done.all() or i == max_new_tokens - 1:
                break
            rng, step_rng = jax.random.split(rng)
            token, cache = self._step(params, cache, token[:, None], jnp.asarray((lengths + i)[:, None]),
                                      jnp.asarray(last), step_rng)
        return [_until(list(row[:i + 1]), stop_token) for row in produced]


def _until(tokens: list[int], stop_token: int | None) -> list[int]:
    return tokens[:tokens.index(stop_token)] if stop_token in tokens else tokens


def generate(cfg: ModelConfig, params, prompts: list[list[int]], max_new_tokens: int, rng: jax.Array,
             sampling: Sampling = GREEDY, stop_token: int | None = None) -> list[list[int]]:
    """KV-cache generation for a batch of prompts (compiles a Generator for this shape)."""
    cache_len = max(map(len, prompts)) + max_new_tokens
    return Generator(cfg, len(prompts), cache_len, sampling)(params, prompts, max_new_tokens, rng, stop_token)


def generate_without_cache(cfg: ModelConfig, params, prompt: list[int], max_new_tokens: int, rng: jax.Array,
                           sampling: Sampling = GREEDY, stop_token: int | None = None) -> list[int]:
    """The reference: every new token re-runs the model over the whole sequence so far (one compiled
    shape of prompt + max_new_tokens; the causal mask keeps the padding after it unseen)."""
    model, window = Llama(cfg), len(prompt) + max_new_tokens

    @jax.jit
    def next_token(params, tokens, length, rng):
        logits = model.apply({"params": params}, tokens)
        return sample_next(logits[:, length - 1], rng, sampling)

    tokens = np.zeros((1, window), np.int32)
    tokens[0, :len(prompt)] = prompt
    produced = []
    for length in range(len(prompt), window):
        rng, step_rng = jax.random.split(rng)
        token = int(next_token(params, jnp.asarray(tokens), length, step_rng)[0])
        if token == stop_token:
            break
        tokens[0, length] = token
        produced.append(token)
    return produced


def sample_text(config: Config, params, tokenizer) -> str:
    """The trainer's end-of-run sample: train.sample_prompt continued by train.sample_tokens tokens."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    new_tokens = min(config.train.sample_tokens, config.model.max_seq_len - 1)
    prompt = [*bos, *tokenizer.encode(config.train.sample_prompt)][-(config.model.max_seq_len - new_tokens):]
    (new,) = generate(config.model, params, [prompt], new_tokens, jax.random.key(config.seed),
                      Sampling(temperature=0.8, top_k=40), stop_token=tokenizer.eos_id)
    return config.train.sample_prompt + tokenizer.decode(new)
