"""Llama 3 in Flax NNX, top to bottom.

    tokens [batch, seq]
      -> embed                                   [batch, seq, embed]
         (prompt tuning / P-tuning: learned virtual tokens fill the slots left in front of each document)
      -> n_layers x Block (the layer stack, stack/: under a scan, or as pipeline stages):
           x + Attention(RMSNorm(x))             grouped-query attention with rotary positions
           x + MLP(RMSNorm(x))                   SwiGLU
      -> RMSNorm -> output projection            [batch, seq, vocab] logits
                    (or, given targets, fused with the loss: loss.py)

Each module builds its parameters in `__init__` (nnx.Param, each carrying its *logical* axis names: ``embed``,
``heads``, ...) and does its math in `__call__`. The layers are one Block whose params are stacked along a
leading ``layers`` axis (nnx.vmap at construction); the stack (stack/) runs them. The model knows nothing about
devices: sharding.py maps the logical names onto a mesh, and the activations a backward pass may keep carry
``checkpoint_name`` tags that remat.py turns into recomputation policies. What a trace is for (the platform, the
mesh, the logical-axis rules) is the model's `context`, a TraceContext (context.py) chosen by whoever builds it
(TrainProgram; by default this process, no mesh).

The programs that run the model are pure functions of its params: they split it once (nnx.split: a graph and a
plain dict of arrays, the train state's `params`, whose paths are the checkpoints') and merge it back inside the
jitted function (`nnx.merge(graph, params)(tokens, ...)`), so a step takes and returns arrays only.

Parameter-efficient tuning (the peft.* section) adds its adapters here, as parameters like any other: LoRA's
A and B inside the projections it adapts, the prompt's embeddings (or P-tuning's prompt encoder, prompt_encoder.py)
at the top. Which of them learn, and which stay frozen, is the train step's business (step.py, peft.py).
"""

from __future__ import annotations

import functools
import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from llama_jax.config import ModelConfig, PeftConfig, RematConfig
from llama_jax.model import remat
from llama_jax.model.attention import attention, cached_attention, select_implementation
from llama_jax.model.context import TraceContext
from llama_jax.model.dropout import DropoutKey
from llama_jax.model.embedding import lookup
from llama_jax.model.loss import LOGITS, OUTPUT_WEIGHT, fused_cross_entropy_sum
from llama_jax.model.norm import rms_norm
from llama_jax.model.params import abstract, is_param, named, param, stacked
from llama_jax.model.pipeline import PipelineLayout
from llama_jax.model.projection import fp8_project, project, quantized_input, uses_cpu_backward
from llama_jax.model.prompt_encoder import PromptEncoder
from llama_jax.model.rope import apply_rope, rope_angles
from llama_jax.model.stack import Head, LayerInputs, Stack, run_stack

# Logical names of activation axes. Parameters use `embed`, `heads`, ...; activations get their own
# names because they shard differently (an FSDP run shards weights along `embed` but activations
# along `batch`). `residual_seq` is the sequence axis of the residual stream between the attention
# and MLP blocks, which Megatron-style sequence parallelism shards.
RESIDUAL = ("batch", "residual_seq", "act_embed")
HIDDEN = ("batch", "seq", "act_embed")
HEADS = ("batch", "seq", "act_heads", "head_dim")
KV_HEADS = ("batch", "seq", "act_kv_heads", "head_dim")
MLP_HIDDEN = ("batch", "seq", "act_mlp")
# In loss.py: LOGITS = ("batch", "seq", "act_vocab"), OUTPUT_WEIGHT = ("embed", "vocab")


def output_init_std(cfg: ModelConfig) -> float:
    """Init scale of the projections that write into the residual stream (attention out, MLP down).

    Scaled by 1/sqrt(2 x layers), GPT-2 style, so the residual stream's variance does not grow
    with depth.
    """
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)


def layer_inputs(cfg: ModelConfig, segment_ids: jax.Array | None, positions: jax.Array) -> LayerInputs:
    """What every layer reads besides the residual stream: the rotary angles of the positions (rope.py), the
    documents (segment_ids) and the positions [batch, seq] themselves."""
    return LayerInputs(*rope_angles(positions, cfg), segment_ids, positions)


class KVCache(NamedTuple):
    """Decoding's keys and values of earlier tokens, [batch, cache_len, kv_heads, head_dim] each (stacked
    [layers, ...] for the model): slot p holds the token at position p."""

    key: jax.Array
    value: jax.Array


def init_cache(cfg: ModelConfig, batch: int, cache_len: int) -> KVCache:
    """An empty cache for every layer, [layers, batch, cache_len, kv_heads, head_dim], in the compute dtype."""
    shape = (cfg.n_layers, batch, cache_len, cfg.n_kv_heads, cfg.resolved_head_dim)
    return KVCache(*(jnp.zeros(shape, jnp.dtype(cfg.compute_dtype)) for _ in range(2)))


# ---------------------------------------------------------------------------------------------
# Layers


class RMSNorm(nnx.Module):
    """x / rms(x) · scale (norm.py), the scale [features] learned."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.scale = param(rngs, nnx.initializers.ones, (cfg.d_model,), ("norm",), cfg.param_dtype)
        self.eps, self.dtype = cfg.norm_eps, jnp.dtype(cfg.compute_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.dtype)


class Linear(nnx.Module):
    """y = einsum(spec, x, W): a bias-free projection whose weight W carries logical axis names.

    With peft.method=lora on this projection it adds LoRA's low-rank update, (alpha / rank) · (x A) B, with
    A [in..., rank] and B [rank, out...] named like W's input and output axes, so they shard like W.
    """

    def __init__(self, spec, shape, names, std, *, target, cfg: ModelConfig, peft, context, rngs: nnx.Rngs):
        self.spec, self.names, self.context = spec, names, context
        self.dtype, self.fp8 = jnp.dtype(cfg.compute_dtype), cfg.fp8 != "none"  # fp8: projection.py
        self.cpu_backward = uses_cpu_backward(context.platform, cfg.cpu_projection)
        self.kernel = param(rngs, nnx.initializers.normal(std), shape, names, cfg.param_dtype)
        self.lora_rank = peft.lora_rank(target)
        if self.lora_rank:
            self.lora_scale = peft.alpha / self.lora_rank
            n_in = self.contracted  # W's input axes
            # A as PEFT initialises it (uniform, bound 1 / sqrt(fan_in)); B zero, so the update starts at
            # exactly 0 and step 0 computes the base model's outputs bit for bit.
            a_init = nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=tuple(range(n_in)))
            self.a_names, self.b_names = (*names[:n_in], "lora_rank"), ("lora_rank", *names[n_in:])
            a_shape, b_shape = (*shape[:n_in], self.lora_rank), (self.lora_rank, *shape[n_in:])
            self.lora_a = param(rngs, a_init, a_shape, self.a_names, cfg.param_dtype)
            self.lora_b = param(rngs, nnx.initializers.zeros, b_shape, self.b_names, cfg.param_dtype)
            self.dropout = nnx.Dropout(peft.dropout) if peft.dropout else None

    @property
    def contracted(self) -> int:
        """How many of W's leading axes x is contracted with."""
        inputs, kernel_axes = self.spec.split("->")[0].split(",")
        return len(set(inputs) & set(kernel_axes))

    def __call__(self, x, x_fp8=None, dropout: DropoutKey | None = None) -> jax.Array:
        """x_fp8: x quantized by the caller (fp8_input), shared by the projections of one input. dropout: the key
        of LoRA's dropout (training only)."""
        kernel = self.context.read(self.kernel[...].astype(self.dtype), self.names)
        if self.fp8:  # the LoRA update stays in the compute dtype
            y = fp8_project(self.spec, x.astype(self.dtype), kernel, x_fp8)
        else:  # = jnp.einsum(spec, x, kernel), with a faster backward pass on CPU
            y = project(self.spec, x.astype(self.dtype), kernel, self.cpu_backward)
        return y + self.low_rank_update(x, dropout) if self.lora_rank else y

    def low_rank_update(self, x: jax.Array, dropout: DropoutKey | None) -> jax.Array:
        inputs, kernel_axes = self.spec.split("->")[0].split(",")
        outputs, n_in = self.spec.split("->")[1], self.contracted
        rank = next(c for c in "rzyxw" if c not in self.spec)  # an einsum letter for the rank axis
        tokens = "".join(c for c in inputs if c not in kernel_axes)
        if self.dropout is not None and dropout is not None:  # training only: evaluation passes no key
            x = self.dropout(x, rngs=dropout.mask())
        a = self.context.read(self.lora_a[...].astype(self.dtype), self.a_names)
        b = self.context.read(self.lora_b[...].astype(self.dtype), self.b_names)
        x = x.astype(self.dtype)
        down = project(f"{inputs},{kernel_axes[:n_in]}{rank}->{tokens}{rank}", x, a, self.cpu_backward)
        down = down * jnp.asarray(self.lora_scale, self.dtype)  # scaled on the narrow side
        return project(f"{tokens}{rank},{rank}{kernel_axes[n_in:]}->{outputs}", down, b, self.cpu_backward)


def fp8_input(cfg: ModelConfig, x: jax.Array, tag: str) -> tuple[jax.Array, jax.Array] | None:
    """Under model.fp8, x quantized once for the projections that read it (projection.quantized_input)."""
    return None if cfg.fp8 == "none" else quantized_input(x.astype(jnp.dtype(cfg.compute_dtype)), tag)


def child(dropout: DropoutKey | None, name: str) -> DropoutKey | None:
    """The dropout key a sub-module `name` is handed (dropout.py); None where there is no dropout."""
    return None if dropout is None else dropout.child(name)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, peft: PeftConfig, load_balanced: bool, context, rngs: nnx.Rngs):
        self.cfg, self.load_balanced, self.context = cfg, load_balanced, context
        d, n, kv, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
        linear = partial(Linear, cfg=cfg, peft=peft, context=context, rngs=rngs)
        std, out_std = cfg.init_std, output_init_std(cfg)
        self.q_proj = linear("btd,dnh->btnh", (d, n, h), ("embed", "heads", "head_dim"), std, target="q")
        self.k_proj = linear("btd,dkh->btkh", (d, kv, h), ("embed", "kv_heads", "head_dim"), std, target="k")
        self.v_proj = linear("btd,dkh->btkh", (d, kv, h), ("embed", "kv_heads", "head_dim"), std, target="v")
        self.o_proj = linear("btnh,nhd->btd", (n, h, d), ("heads", "head_dim", "embed"), out_std, target="o")

    def __call__(self, x, inputs: LayerInputs, dropout=None, cache: KVCache | None = None):
        """x [batch, seq, embed] -> (out [batch, seq, embed], the cache with this call's keys and values)."""
        cfg, constrain, h = self.cfg, self.context.constrain, self.cfg.resolved_head_dim
        x8 = fp8_input(cfg, x, "attn_norm")
        q = self.q_proj(x, x8, child(dropout, "q_proj"))
        k = self.k_proj(x, x8, child(dropout, "k_proj"))
        v = self.v_proj(x, x8, child(dropout, "v_proj"))
        q = constrain(checkpoint_name(q, "query_proj"), HEADS)
        k = constrain(checkpoint_name(k, "key_proj"), KV_HEADS)
        v = constrain(checkpoint_name(v, "value_proj"), KV_HEADS)

        q, k = apply_rope(q, inputs.cos, inputs.sin), apply_rope(k, inputs.cos, inputs.sin)
        if cache is not None:  # decoding: earlier tokens' keys and values come from the cache
            cache = self.cached(cache, k, v, inputs.positions)
            context = cached_attention(q, cache.key, cache.value, inputs.positions)
        else:
            implementation = select_implementation(
                cfg.attention, self.context.platform, q.dtype, h, q.shape[1], strict=False
            )
            segments, balanced = inputs.segment_ids, self.load_balanced
            max_segments = cfg.attention_max_segments
            context = attention(q, k, v, segments, implementation, max_segments, balanced, context=self.context)
        context = constrain(checkpoint_name(context, "attention_context"), HEADS)
        out = self.o_proj(context, fp8_input(cfg, context, "attention_context"), child(dropout, "o_proj"))
        return checkpoint_name(out, "attention_out"), cache

    def cached(self, cache: KVCache, k, v, positions) -> KVCache:
        """This call's keys/values written into the cache at slots = their positions: a prefill writes a prompt
        at once, each decode step one token per row, at that row's position."""
        write = jax.vmap(lambda cache, new, start: jax.lax.dynamic_update_slice_in_dim(cache, new, start, 0))
        return KVCache(
            self.context.constrain(write(cache.key, k, positions[:, 0]), KV_HEADS),
            self.context.constrain(write(cache.value, v, positions[:, 0]), KV_HEADS),
        )


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, peft: PeftConfig, context, rngs: nnx.Rngs):
        self.cfg, self.context = cfg, context
        d, f = cfg.d_model, cfg.ffn_dim
        linear = partial(Linear, cfg=cfg, peft=peft, context=context, rngs=rngs)
        self.gate_proj = linear("btd,df->btf", (d, f), ("embed", "mlp"), cfg.init_std, target="gate")
        self.up_proj = linear("btd,df->btf", (d, f), ("embed", "mlp"), cfg.init_std, target="up")
        self.down_proj = linear("btf,fd->btd", (f, d), ("mlp", "embed"), output_init_std(cfg), target="down")

    def __call__(self, x, dropout=None):
        x8 = fp8_input(self.cfg, x, "mlp_norm")
        gate = self.gate_proj(x, x8, child(dropout, "gate_proj"))
        up = self.up_proj(x, x8, child(dropout, "up_proj"))
        gate = self.context.constrain(checkpoint_name(gate, "mlp_gate"), MLP_HIDDEN)
        up = self.context.constrain(checkpoint_name(up, "mlp_up"), MLP_HIDDEN)
        hidden = checkpoint_name(nnx.silu(gate) * up, "mlp_hidden")  # SwiGLU
        out = self.down_proj(hidden, fp8_input(self.cfg, hidden, "mlp_hidden"), child(dropout, "down_proj"))
        return checkpoint_name(out, "mlp_out")


class Block(nnx.Module):
    """One pre-norm transformer layer. Every way of running the stack (stack/) gives it the same LayerInputs."""

    def __init__(self, cfg: ModelConfig, peft: PeftConfig, load_balanced: bool, context, rngs: nnx.Rngs):
        self.context = context  # inside a pipeline stage, the stage's (Stack.inside_stage)
        self.attn_norm = RMSNorm(cfg, rngs)
        self.attn = Attention(cfg, peft, load_balanced, context, rngs)
        self.mlp_norm = RMSNorm(cfg, rngs)
        self.mlp = MLP(cfg, peft, context, rngs)

    def __call__(self, x, inputs: LayerInputs, dropout: DropoutKey | None = None, cache: KVCache | None = None):
        """x [batch, seq, embed] -> (x after the layer, the layer's cache: None unless decoding)."""
        constrain = self.context.constrain
        h = constrain(checkpoint_name(self.attn_norm(x), "attn_norm"), HIDDEN)
        attended, cache = self.attn(h, inputs, child(dropout, "attn"), cache)
        x = constrain(x + attended, RESIDUAL)
        h = constrain(checkpoint_name(self.mlp_norm(x), "mlp_norm"), HIDDEN)
        x = constrain(x + self.mlp(h, child(dropout, "mlp")), RESIDUAL)
        return x, cache


class Llama(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        remat_config: RematConfig = RematConfig(),
        # How a sequence split over the mesh's `sequence` axis is laid out (mesh.load_balance): early and late
        # chunks paired per device (sharding.balance_sequence) or in order. Causal attention needs to know which
        # keys come before which queries; positions restart per document and cannot tell.
        load_balanced: bool = True,
        peft: PeftConfig = PeftConfig(),  # adapters: LoRA in the projections, or a learned prompt
        # Training under pipeline parallelism (mesh.pipeline > 1): the layers run as stages over micro-batches.
        pipeline: PipelineLayout | None = None,
        # What the trace is for: the platform whose kernels run, the mesh and the logical-axis rules (context.py).
        context: TraceContext | None = None,
    ):
        self.cfg, self.remat_config, self.peft, self.pipeline = cfg, remat_config, peft, pipeline
        self.context = context = context or TraceContext.local()
        self.block = partial(Block, cfg, peft, load_balanced)  # (context, rngs) -> one layer
        std, dtype = cfg.init_std, jnp.dtype(cfg.param_dtype)
        table = named(nnx.initializers.normal(std), ("vocab", "embed"))
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=table, param_dtype=dtype, rngs=rngs)
        self.layers = stacked(lambda rngs: self.block(context, rngs), cfg.n_layers, rngs)  # params [n_layers, ...]
        self.final_norm = RMSNorm(cfg, rngs)
        if not cfg.tie_embeddings:  # tied: the embedding table, transposed
            output = named(nnx.initializers.normal(std), OUTPUT_WEIGHT)  # [embed, vocab]
            self.lm_head = nnx.Linear(
                cfg.d_model, cfg.vocab_size, use_bias=False, kernel_init=output, param_dtype=dtype, rngs=rngs
            )
        if peft.method == "prompt":
            prompts = named(nnx.initializers.normal(std), ("virtual_tokens", "embed"))
            self.prompt = nnx.Embed(
                peft.prompt_tokens, cfg.d_model, embedding_init=prompts, param_dtype=dtype, rngs=rngs
            )
        elif peft.method == "ptuning":
            self.prompt_encoder = PromptEncoder(cfg, peft, rngs)

    def __call__(
        self, tokens, positions=None, segment_ids=None, targets=None, loss_mask=None, *, cache=None, dropout_key=None
    ):
        """tokens [batch, seq] int -> logits [batch, seq, vocab] (compute dtype); given targets [batch, seq] (and
        loss_mask), the summed next-token loss and its token count (fp32); given a cache (decoding: tokens at
        `positions` see the cached ones before them), (logits, the cache with these tokens too). positions restart
        at 0 for every packed document, segment_ids (>= 1 per document) keep documents apart (without them a row
        is one document). dropout_key: LoRA's dropout (training a peft run)."""
        cfg, context = self.cfg, self.context
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        if targets is not None and loss_mask is None:
            loss_mask = jnp.ones(targets.shape, jnp.float32)
        x = self.embeddings(tokens)  # [batch, seq, embed]
        stack, head = self.stack(), {"norm": self.final_norm.scale[...], "output": self.output_weight()}
        layers = nnx.to_pure_dict(nnx.state(self.layers))  # [n_layers, ...] each
        if targets is not None and stack.computes_loss:  # 1F1B: each micro-batch's loss on the pipeline's last stage
            loss = Head(partial(final_loss, cfg), head, targets, loss_mask)
            return run_stack(stack, layers, x, segment_ids, positions, loss), jnp.sum(loss_mask)
        if cache is not None:  # decoding: the layers read and extend the cache
            x, cache = run_stack(stack, layers, x, segment_ids, positions, cache=cache)
        else:
            x = run_stack(stack, layers, x, segment_ids, positions, dropout_key=dropout_key)
        x = rms_norm(x, head["norm"], cfg.norm_eps, jnp.dtype(cfg.compute_dtype))  # the final norm
        if targets is not None:  # training and evaluation: the logits never exist as a whole
            return next_token_loss(x, head["output"].astype(cfg.compute_dtype), targets, loss_mask, context)
        logits = self.logits(x, head["output"])
        return logits if cache is None else (logits, cache)

    def embeddings(self, tokens: jax.Array) -> jax.Array:
        """[batch, seq, embed]: each token's row of the table; at a learned prompt's slots, the prompt's."""
        table = self.context.read(self.embed.embedding[...].astype(self.cfg.compute_dtype), ("vocab", "embed"))
        x = lookup(table, jnp.maximum(tokens, 0), self.context)  # = embed(tokens), reading the table as `read` says
        if self.peft.virtual_tokens:
            x = jnp.where(tokens[..., None] < 0, self.virtual_embeddings(tokens).astype(x.dtype), x)
        return self.context.constrain(x, RESIDUAL)

    def logits(self, x: jax.Array, output: jax.Array) -> jax.Array:
        """[batch, seq, vocab]: x after the final norm, projected by the [embed, vocab] output weight."""
        output = self.context.read(output.astype(self.cfg.compute_dtype), OUTPUT_WEIGHT)
        cpu_backward = uses_cpu_backward(self.context.platform, self.cfg.cpu_projection)
        return self.context.constrain(project("btd,dv->btv", x, output, cpu_backward), LOGITS)

    def stack(self) -> Stack:
        """How the layers run (stack/): under a scan, in groups of recomputation, or as pipeline stages; every
        way applies one Block to the same LayerInputs."""
        return Stack(
            block=self.block,
            inputs=partial(layer_inputs, self.cfg),
            names=RESIDUAL,
            context=self.context,
            policy=remat.checkpoint_policy(self.remat_config),
            every_n=self.remat_config.every_n_layers,
            pipeline=self.pipeline,
        )

    def output_weight(self) -> jax.Array:
        """[embed, vocab] the output projection: the embedding table, transposed, when tied."""
        return self.embed.embedding[...].T if self.cfg.tie_embeddings else self.lm_head.kernel[...]

    def virtual_embeddings(self, tokens: jax.Array) -> jax.Array:
        """[batch, seq, embed]: at every prompt slot its learned embedding (elsewhere: to be ignored).

        The loader leaves peft.prompt_tokens slots in front of every document (data/loader.py), holding
        token ids -1, -2, ...: slot k takes row k of the prompt, at the positions 0..k of its document.
        """
        prompt = self.prompt_encoder() if self.peft.method == "ptuning" else self.prompt.embedding[...]
        return jnp.take(prompt, jnp.clip(-tokens - 1, 0, self.peft.prompt_tokens - 1), axis=0)


def final_loss(cfg: ModelConfig, params, x, targets, loss_mask, context: TraceContext) -> jax.Array:
    """The summed next-token loss of final activations x: the final norm, the output projection and the
    cross-entropy, with params {"norm": the norm's scale, "output": [embed, vocab]} (a pipeline's last stage),
    traced in `context` (the stage's, which runs it: Head)."""
    x = rms_norm(x, params["norm"], cfg.norm_eps, jnp.dtype(cfg.compute_dtype))
    return next_token_loss(x, params["output"].astype(cfg.compute_dtype), targets, loss_mask, context)[0]


def next_token_loss(x, output, targets, loss_mask, context: TraceContext) -> tuple[jax.Array, jax.Array]:
    """The summed next-token loss and its token count from the final norm's x and the [embed, vocab] output
    weight: gathered once for the loss's loop over chunks (loss.py), each device keeping its partial dW."""
    output = context.gathered(output, OUTPUT_WEIGHT)
    return fused_cross_entropy_sum(x, output, targets, loss_mask, context.rules, context.token_shards())


# ---------------------------------------------------------------------------------------------
# The model as the programs use it: its graph, and its params as a plain dict (their shapes, their names)


def abstract_model(cfg: ModelConfig, peft: PeftConfig = PeftConfig(), **options) -> Llama:
    """The model with ShapeDtypeStructs for params: its graph and shapes, nothing allocated or computed."""
    return abstract(lambda: Llama(cfg, peft=peft, rngs=nnx.Rngs(0), **options))


def init_params(cfg: ModelConfig, key: jax.Array, peft: PeftConfig = PeftConfig()) -> dict:
    """Freshly initialised params of the model (with `peft`'s adapters), a plain dict of arrays."""
    return nnx.to_pure_dict(nnx.state(Llama(cfg, peft=peft, rngs=nnx.Rngs(params=key)), nnx.Param))


@functools.lru_cache(maxsize=64)  # asked for per mesh, plan and sweep candidate: 0.1 s each for a Llama 3 preset
def abstract_params(cfg: ModelConfig, peft: PeftConfig = PeftConfig()) -> dict:
    """The params (with `peft`'s adapters) as nnx.Params holding ShapeDtypeStructs, with their logical axis names,
    in a plain dict: without allocating them."""
    return nnx.to_pure_dict(nnx.state(abstract_model(cfg, peft), nnx.Param), lambda v: v)


def param_shapes(cfg: ModelConfig, peft: PeftConfig = PeftConfig()) -> dict:
    """ShapeDtypeStructs of the params (a plain dict like the params)."""
    return jax.tree.map(lambda p: p.get_value(), abstract_params(cfg, peft), is_leaf=is_param)


def param_count(cfg: ModelConfig) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(param_shapes(cfg)))
