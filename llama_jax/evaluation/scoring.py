"""Log-likelihoods of continuations, batched by length: what lm-eval's `loglikelihood` requests ask a model.

A request is (context tokens, continuation tokens). Its input is context + continuation without the last
token, cut from the left to the model's length as lm-eval's `hf` backend cuts it, and its score is the sum
of the continuation tokens' log-probabilities, with whether each was the argmax (lm-eval's is_greedy).

Requests are sorted longest first and scored `batch` at a time, each batch right-padded to a length of
16 · 2^k tokens (a causal model's padding on the right changes nothing before it), so a task compiles a
few programs, not one per request length. On a mesh the batch's rows go over the data/fsdp axes that
divide it and the model is sharded as the params are (the logical-axis table of sharding.py, as
inference/generate.py runs it); the scores come back replicated, so every process of a multi-process
run reads the same numbers.
"""

from __future__ import annotations

from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from llama_jax.config import ModelConfig, PeftConfig
from llama_jax.distributed import sharding
from llama_jax.inference.generate import decoding_rules, default_rules
from llama_jax.model import peft
from llama_jax.model.context import TraceContext, logical_to_mesh_axes
from llama_jax.model.llama import abstract_model

SHORTEST_BUCKET = 16


def bucket(length: int, longest: int) -> int:
    """The padded length of a batch whose longest input is `length`: 16 · 2^k, at most `longest`."""
    padded = SHORTEST_BUCKET
    while padded < length:
        padded *= 2
    return min(padded, longest)


def _sharing_key(index: int, whole: list[int], scored: int) -> tuple:
    """Requests with the same key are scored in one row: one-token continuations of the same input."""
    return ("input", *whole[:-1]) if scored == 1 else ("request", index)


class Scorer:
    """Compiled scoring of up to `batch` requests at a time for one model (with `adapters`: a learned prompt's
    slots go in front), on one device or on `mesh` (where the params are) under `rules` (default: the
    standard table for the mesh). A batch has `rows(n)` rows for n requests: a few shapes, and no rows of padding
    to speak of when a task has fewer requests than `batch`."""

    def __init__(
        self,
        cfg: ModelConfig,
        batch: int,
        mesh: Mesh | None = None,
        rules: tuple | None = None,
        adapters: PeftConfig = PeftConfig(),
    ):
        self.cfg, self.batch, self.mesh, self.adapters = cfg, batch, mesh, adapters
        self.max_length = cfg.max_seq_len - adapters.virtual_tokens  # tokens a request's input may hold
        self.rules = None if mesh is None else (rules or default_rules(cfg, mesh))
        self._programs: dict[int, tuple] = {}

    def _program(self, rows: int) -> tuple:
        """(the jitted scoring of `rows` rows, the sharding of its inputs) for one batch size."""
        if rows not in self._programs:
            mesh, prompt = self.mesh, self.adapters.virtual_tokens
            rules = None if mesh is None else decoding_rules(self.rules, mesh, rows)
            context = TraceContext.local() if mesh is None else TraceContext.on_mesh(mesh, rules)
            graph = nnx.graphdef(abstract_model(self.cfg, self.adapters, context=context))

            def score(params, tokens, targets, weights):
                logits = nnx.merge(graph, params)(tokens)[:, prompt:].astype(jnp.float32)
                logp = jax.nn.log_softmax(logits, axis=-1)
                chosen = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
                best = jnp.argmax(logits, axis=-1)
                greedy = (best == targets) | (weights == 0)
                last = jnp.sum(weights > 0, axis=-1) + jnp.argmax(weights, axis=-1) - 1  # the last scored position
                rows = jnp.arange(logits.shape[0])
                return jnp.sum(chosen * weights, axis=-1), jnp.all(greedy, axis=-1), logp[rows, last], best[rows, last]

            replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
            placement = None if mesh is None else NamedSharding(mesh, logical_to_mesh_axes(("batch", None), rules))
            self._programs[rows] = (jax.jit(score, out_shardings=replicated), placement)
        return self._programs[rows]

    def rows(self, requests: int) -> int:
        """The rows of a batch of `requests`: the next power of two, at most `batch`."""
        return min(self.batch, 1 << max(requests - 1, 0).bit_length())

    def window(self, context: list[int], continuation: list[int]) -> tuple[list[int], int]:
        """(the input and target tokens, one longer than the input, how many at the end are scored)."""
        whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
        return whole, min(len(continuation), len(whole) - 1)

    def __call__(self, params, requests: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether every continuation token was the argmax)
        of each request, in the order given. Requests with one continuation token and the same input (the
        choices of a multiple-choice question, mostly) share one row: the others read their token's
        log-probability from that row's last position, as lm-eval's hf backend shares them."""
        windows = [self.window(context, continuation) for context, continuation in requests]
        shared: dict[tuple, list[int]] = {}
        for i, (whole, scored) in enumerate(windows):
            shared.setdefault(_sharing_key(i, whole, scored), []).append(i)
        leaders = sorted((members[0] for members in shared.values()), key=lambda i: -len(windows[i][0]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(windows)
        for start in range(0, len(leaders), self.batch):
            chunk = leaders[start : start + self.batch]
            sums, greedy, last_logp, last_best = self._score_batch(params, [windows[i] for i in chunk])
            for row, i in enumerate(chunk):
                results[i] = (float(sums[row]), bool(greedy[row]))
                for other in shared[_sharing_key(i, *windows[i])][1:]:
                    target = windows[other][0][-1]
                    results[other] = (float(last_logp[row, target]), bool(last_best[row] == target))
        return results

    def _score_batch(self, params, windows: list[tuple[list[int], int]]) -> tuple[np.ndarray, ...]:
        """(sums, all greedy, log-probabilities at the last scored position [rows, vocab], its argmax) of a batch."""
        rows, length = self.rows(len(windows)), bucket(len(windows[0][0]) - 1, self.max_length)
        tokens = np.zeros((rows, length), np.int32)
        targets = np.zeros((rows, length), np.int32)
        weights = np.zeros((rows, length), np.float32)
        for row, (whole, scored) in enumerate(windows):
            n = len(whole) - 1
            tokens[row, :n], targets[row, :n] = whole[:-1], whole[1:]
            weights[row, n - scored : n] = 1.0
        if self.adapters.virtual_tokens:
            slots = peft.with_prompt_slots([[]], self.adapters.virtual_tokens)[0]
            tokens = np.concatenate([np.broadcast_to(np.int32(slots), (rows, len(slots))), tokens], 1)
        score, placement = self._program(rows)

        def put(x: np.ndarray) -> jax.Array:
            return (
                jnp.asarray(x) if placement is None else jax.make_array_from_callback(x.shape, placement, x.__getitem__)
            )

        with nullcontext() if self.mesh is None else sharding.activate(self.mesh):
            return tuple(np.asarray(x) for x in score(params, put(tokens), put(targets), put(weights)))
