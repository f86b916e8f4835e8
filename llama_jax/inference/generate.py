"""Text generation: prefill the prompts once, then one jitted decode step per new token.

The key/value cache is preallocated for prompt + new tokens ([layers, batch, cache_len, kv_heads, head_dim]
per tensor, in the compute dtype) and carries the logical axis names of the model's keys and values. On a mesh
(the one the params are sharded over: `api.load(..., overrides=["mesh.tensor=8"])`) the steps are traced for
that mesh and run under the logical-axis table of sharding.py (the model's TraceContext, model/context.py), so
the cache is sharded like the keys and values: rows over the data/fsdp axes that divide the batch, kv heads
over `tensor` where they divide. Nothing is split along the sequence: a decode step has one token. Prompts of
different lengths share one batch: each row is right-padded, and row r's token at position p goes to cache
slot p, so padding is overwritten before any query can see it.

A prompt-tuned model (peft: a learned prompt, params["prompt"]) gets its prompt's slots in front of every
prompt, as the loader puts them in front of every document in training.

`generate_without_cache` is the reference: it re-runs the whole window for every token (O(length²)),
and tests check that both produce the same greedy tokens.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from llama_jax.config import Config, MeshConfig, ModelConfig, PeftConfig
from llama_jax.config.choices import MESH_AXES
from llama_jax.distributed import sharding
from llama_jax.errors import ConfigError
from llama_jax.model import peft
from llama_jax.model.context import TraceContext, logical_to_mesh_axes
from llama_jax.model.llama import KV_HEADS, abstract_model, init_cache
from llama_jax.model.pipeline import without_stage_axis
from llama_jax.model.stages import NATURAL, LayerOrder, relayout

# The cache's logical axes: one [batch, cache_len, kv_heads, head_dim] block of keys or values per layer.
CACHE_AXES = ("layers", *KV_HEADS)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8  # 0: greedy
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches p (1: all)

    def check(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got "
                f"temperature {self.temperature}, top_k {self.top_k}, top_p {self.top_p}"
            )


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


def params_mesh(params) -> Mesh | None:
    """The mesh the params are sharded over (None: they are on one device)."""
    placement = getattr(jax.tree.leaves(params)[0], "sharding", None)
    return placement.mesh if isinstance(placement, NamedSharding) and placement.mesh.size > 1 else None


def default_rules(cfg: ModelConfig, mesh: Mesh) -> tuple:
    """The logical-axis table (sharding.axis_rules) of a run of this model on this mesh."""
    if sorted(mesh.axis_names) != sorted(MESH_AXES):
        raise ConfigError(
            f"generation needs a mesh with the axes {', '.join(MESH_AXES)} (sharding.make_mesh), "
            f"got {', '.join(mesh.axis_names)}"
        )
    return sharding.axis_rules(Config(model=cfg, mesh=MeshConfig(**dict(mesh.shape))))


def decoding_rules(rules: tuple, mesh: Mesh, batch: int) -> tuple:
    """The table for decoding `batch` rows: the batch over those of its mesh axes whose product divides
    it (outermost first; none: replicated), and no split along the sequence (a decode step has one token).
    Decoding runs no pipeline: its axis is dropped (the cache's layers and batch could not both use it)."""
    table = dict(without_stage_axis(rules))
    axes = table.get("batch") or ()
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    while axes and batch % math.prod(mesh.shape[a] for a in axes):
        axes = axes[:-1]
    table["batch"] = axes or None
    table["seq"] = table["residual_seq"] = None
    return tuple(table.items())


class Generator:
    """Compiled prefill and decode steps for one model (with `adapters`, see the peft.* section), batch size and
    cache length, on one device or on `mesh` (where the params must be) under the logical-axis table `rules`
    (default: the standard table for the mesh, as decoding_rules adapts it to the batch)."""

    def __init__(
        self,
        cfg: ModelConfig,
        batch: int,
        cache_len: int,
        sampling: Sampling = GREEDY,
        mesh: Mesh | None = None,
        rules: tuple | None = None,
        adapters: PeftConfig = PeftConfig(),
    ):
        if cache_len > cfg.max_seq_len:
            raise ConfigError(
                f"prompt + new tokens = {cache_len} exceed model.max_seq_len {cfg.max_seq_len}; "
                "generate fewer tokens or shorten the prompt"
            )
        sampling.check()
        self.cfg, self.batch, self.cache_len, self.sampling, self.mesh = cfg, batch, cache_len, sampling, mesh
        self.rules = None if mesh is None else decoding_rules(rules or default_rules(cfg, mesh), mesh, batch)
        context = TraceContext.local() if mesh is None else TraceContext.on_mesh(mesh, self.rules)
        graph = nnx.graphdef(abstract_model(cfg, adapters, context=context))
        # The cache starts as zeros, made in its shards.
        empty = jax.eval_shape(lambda: init_cache(cfg, batch, cache_len))
        self.cache_shardings = (
            None
            if mesh is None
            else jax.tree.map(lambda _: NamedSharding(mesh, logical_to_mesh_axes(CACHE_AXES, self.rules)), empty)
        )
        self._empty_cache = jax.jit(lambda: init_cache(cfg, batch, cache_len), out_shardings=self.cache_shardings)

        def step(params, cache, tokens, positions, last, rng):
            logits, cache = nnx.merge(graph, params)(tokens, positions, cache=cache)
            chosen = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]  # [batch, vocab]
            return sample_next(chosen, rng, self.sampling), cache

        # On a mesh the chosen tokens come back replicated: every process can read them.
        outputs = None if mesh is None else (NamedSharding(mesh, PartitionSpec()), self.cache_shardings)
        self._step = jax.jit(step, out_shardings=outputs, donate_argnums=(1,))

    def _put(self, x: np.ndarray) -> jax.Array:
        """A host array as a step input: on the default device, or replicated over the mesh (also when the
        mesh spans processes, each of which passes the same value)."""
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(self.mesh, PartitionSpec()), lambda i: x[i])

    def _run(self, *args):
        with nullcontext() if self.mesh is None else sharding.activate(self.mesh):
            return self._step(*args)

    def prefill(self, params, prompts: list[list[int]], rng: jax.Array) -> tuple[jax.Array, dict]:
        """(the first new token of each prompt [batch], the cache holding the prompts)."""
        if len(prompts) != self.batch or any(not p for p in prompts):
            raise ConfigError(f"need {self.batch} non-empty prompt(s), got {[len(p) for p in prompts]}")
        lengths = np.array([len(p) for p in prompts], np.int32)
        tokens = np.zeros((self.batch, int(lengths.max())), np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = prompt
        positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
        return self._run(
            params, self._empty_cache(), self._put(tokens), self._put(positions), self._put(lengths - 1), rng
        )

    def __call__(
        self,
        params,
        prompts: list[list[int]],
        max_new_tokens: int,
        rng: jax.Array,
        stop_token: int | None = None,
        finished=None,
    ) -> list[list[int]]:
        """The new tokens of each prompt: up to max_new_tokens, ending before stop_token if produced. `finished`
        (optional) maps the tokens produced so far [batch, n] to the rows that need no more (e.g. a stop
        sequence in their text): decoding ends once every row is done; the rows' tokens are not cut."""
        lengths = np.array([len(p) for p in prompts], np.int32)
        if lengths.max(initial=0) + max_new_tokens > self.cache_len:
            raise ConfigError(
                f"the longest prompt ({lengths.max()}) + {max_new_tokens} new tokens exceed the "
                f"cache of {self.cache_len}"
            )
        rng, step_rng = jax.random.split(rng)
        token, cache = self.prefill(params, prompts, step_rng)
        produced = np.zeros((self.batch, max_new_tokens), np.int32)
        done = np.zeros(self.batch, bool)
        last = np.zeros(self.batch, np.int32)
        for i in range(max_new_tokens):
            produced[:, i] = np.asarray(token)
            if stop_token is not None:
                done |= produced[:, i] == stop_token
            if finished is not None:
                done |= finished(produced[:, : i + 1])
            if done.all() or i == max_new_tokens - 1:
                break
            rng, step_rng = jax.random.split(rng)
            token, cache = self._run(
                params, cache, token[:, None], self._put((lengths + i)[:, None]), self._put(last), step_rng
            )
        return [_until(list(row[: i + 1]), stop_token) for row in produced]


def _until(tokens: list[int], stop_token: int | None) -> list[int]:
    return tokens[: tokens.index(stop_token)] if stop_token in tokens else tokens


def inference_adapters(params) -> PeftConfig:
    """The adapters inference params hold (peft.inference_params): a learned prompt, or none."""
    prompt_tokens = peft.prompt_tokens_of(params)
    return PeftConfig(method="prompt", prompt_tokens=prompt_tokens) if prompt_tokens else PeftConfig()


def generate(
    cfg: ModelConfig,
    params,
    prompts: list[list[int]],
    max_new_tokens: int,
    rng: jax.Array,
    sampling: Sampling = GREEDY,
    stop_token: int | None = None,
    rules: tuple | None = None,
    adapters: PeftConfig | None = None,
) -> list[list[int]]:
    """KV-cache generation for a batch of prompts (compiles a Generator for this shape), on the mesh the
    params are sharded over, if any, under `rules` (default: the standard table for that mesh). `adapters`
    (default: what the params hold, inference_adapters) with a learned prompt put its slots in front."""
    adapters = inference_adapters(params) if adapters is None else adapters
    prompts = peft.with_prompt_slots(prompts, adapters.virtual_tokens)
    cache_len = max(map(len, prompts)) + max_new_tokens
    generator = Generator(cfg, len(prompts), cache_len, sampling, params_mesh(params), rules, adapters)
    return generator(params, prompts, max_new_tokens, rng, stop_token)


def generate_without_cache(
    cfg: ModelConfig,
    params,
    prompt: list[int],
    max_new_tokens: int,
    rng: jax.Array,
    sampling: Sampling = GREEDY,
    stop_token: int | None = None,
) -> list[int]:
    """The reference: every new token re-runs the model over the whole sequence so far (one compiled
    shape of prompt + max_new_tokens; the causal mask keeps the padding after it unseen)."""
    adapters = inference_adapters(params)
    (prompt,) = peft.with_prompt_slots([prompt], adapters.virtual_tokens)
    graph, window = nnx.graphdef(abstract_model(cfg, adapters)), len(prompt) + max_new_tokens

    @jax.jit
    def next_token(params, tokens, length, rng):
        logits = nnx.merge(graph, params)(tokens)
        return sample_next(logits[:, length - 1], rng, sampling)

    tokens = np.zeros((1, window), np.int32)
    tokens[0, : len(prompt)] = prompt
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
    """The trainer's end-of-run sample: train.sample_prompt continued by train.sample_tokens tokens
    (params as training holds them: the layers in the pipeline's storage order)."""
    order = LayerOrder.of(config.mesh, config.mesh.pipeline)
    params = relayout({"params": params}, order, NATURAL)["params"]
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    new_tokens = min(config.train.sample_tokens, config.model.max_seq_len - 1)
    prompt = [*bos, *tokenizer.encode(config.train.sample_prompt)][-(config.model.max_seq_len - new_tokens) :]
    new_tokens = min(new_tokens, config.model.max_seq_len - len(prompt) - config.peft.virtual_tokens)
    (new,) = generate(
        config.model,
        params,
        [prompt],
        new_tokens,
        jax.random.key(config.seed),
        Sampling(temperature=0.8, top_k=40),
        stop_token=tokenizer.eos_id,
        rules=sharding.axis_rules(config),
        adapters=config.peft,
    )
    return config.train.sample_prompt + tokenizer.decode(new)
