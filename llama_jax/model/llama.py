"""Llama 3 in Flax Linen, top to bottom.

    tokens [batch, seq]
      -> embed                                   [batch, seq, embed]
         (prompt tuning / P-tuning: learned virtual tokens fill the slots left in front of each document)
      -> n_layers x Block (the layer stack, stack/: under nn.scan, or as pipeline stages):
           x + Attention(RMSNorm(x))             grouped-query attention with rotary positions
           x + MLP(RMSNorm(x))                   SwiGLU
      -> RMSNorm -> output projection            [batch, seq, vocab] logits
                    (or, given targets, fused with the loss: loss.py)

The model is functional: ``Llama(cfg).init`` returns a params pytree and ``apply`` is pure. It knows
nothing about devices: every parameter and main activation carries *logical* axis names (``embed``,
``heads``, ``batch``, ...) that sharding.py maps onto a device mesh, and the activations a backward
pass may keep carry ``checkpoint_name`` tags that remat.py turns into recomputation policies. What a
trace is for (the platform, the mesh, the logical-axis rules) is its ``context`` field, a TraceContext
(context.py) that whoever builds the model chooses (TrainProgram; by default this process, no mesh).

Parameter-efficient tuning (the peft.* section) adds its adapters here, as parameters like any other: LoRA's
A and B inside the projections it adapts, the prompt's embeddings (or P-tuning's prompt encoder) at the
top. Which of them learn, and which stay frozen, is the train step's business (step.py, peft.py).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from llama_jax.config import ModelConfig, PeftConfig, RematConfig
from llama_jax.model import remat
from llama_jax.model.attention import attention, cached_attention, select_implementation
from llama_jax.model.context import TraceContext
from llama_jax.model.embedding import lookup
from llama_jax.model.loss import LOGITS, OUTPUT_WEIGHT, fused_cross_entropy_sum
from llama_jax.model.norm import rms_norm
from llama_jax.model.pipeline import PipelineLayout
from llama_jax.model.projection import fp8_project, project, quantized_input, uses_cpu_backward
from llama_jax.model.rope import apply_rope, rope_angles
from llama_jax.model.stack import Head, LayerInputs, Stack, run_stack
from llama_jax.model.stack.scan import scanned

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


def dtypes(cfg: ModelConfig) -> dict[str, jnp.dtype]:
    """The compute and parameter dtypes, as the keyword arguments every layer below takes."""
    return {"dtype": jnp.dtype(cfg.compute_dtype), "param_dtype": jnp.dtype(cfg.param_dtype)}


def output_init_std(cfg: ModelConfig) -> float:
    """Init scale of the projections that write into the residual stream (attention out, MLP down).

    Scaled by 1/sqrt(2 x layers), GPT-2 style, so the residual stream's variance does not grow
    with depth.
    """
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)


def init_normal(std: float, names: tuple[str, ...]):
    """A normal initialiser whose parameter carries logical axis names."""
    return nn.with_logical_partitioning(nn.initializers.normal(std), names)


# ---------------------------------------------------------------------------------------------
# Rotary position embeddings with Llama 3's frequency scaling


def layer_inputs(cfg: ModelConfig, segment_ids: jax.Array | None, positions: jax.Array) -> LayerInputs:
    """What every layer reads besides the residual stream: the rotary angles of the positions, the documents
    (segment_ids) and the positions [batch, seq] themselves."""
    return LayerInputs(*rope_angles(positions, cfg), segment_ids, positions)


# ---------------------------------------------------------------------------------------------
# Layers


class NormScale(nn.Module):
    """RMSNorm's learned scale on its own: the final norm's, which the model applies itself (rms_norm), in the
    head or, under 1F1B, on the pipeline's last stage (final_loss)."""

    features: int
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (self.features,), self.param_dtype
        )


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (x.shape[-1],), self.param_dtype
        )
        return rms_norm(x, scale, self.eps, jnp.dtype(self.dtype))


class Weight(nn.Module):
    """A weight on its own, for code that uses it in more than one einsum (the fused loss)."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    std: float
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("kernel", init_normal(self.std, self.names), self.shape, self.param_dtype)


class Linear(nn.Module):
    """y = einsum(spec, x, W): a bias-free projection whose weight carries logical axis names.

    With lora_rank > 0 (peft.method=lora) it adds LoRA's low-rank update, (alpha / rank) · (x A) B, with
    A [in..., rank] and B [rank, out...] named like W's input and output axes, so they shard like W.
    """

    spec: str
    shape: tuple[int, ...]
    names: tuple[str, ...]
    std: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    cpu_backward: bool = True  # the CPU backward pass (projection.uses_cpu_backward)
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_dropout: float = 0.0
    fp8: bool = False  # model.fp8=tensorwise: fp8 operands (projection.py); the LoRA update stays in dtype
    context: TraceContext = dataclasses.field(default_factory=TraceContext.local)  # how a weight is read (context.read)

    @nn.compact
    def __call__(self, x: jax.Array, x_fp8: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """x_fp8: x quantized by the caller (fp8_input), shared by the projections of one input."""
        kernel = self.param("kernel", init_normal(self.std, self.names), self.shape, self.param_dtype)
        kernel = self.context.read(kernel.astype(self.dtype), self.names)
        if self.fp8:
            y = fp8_project(self.spec, x.astype(self.dtype), kernel, x_fp8)
        else:  # = jnp.einsum(spec, x, kernel), with a faster backward pass on CPU
            y = project(self.spec, x.astype(self.dtype), kernel, self.cpu_backward)
        return y + self.low_rank_update(x) if self.lora_rank else y

    def low_rank_update(self, x: jax.Array) -> jax.Array:
        inputs, kernel_axes = self.spec.split("->")[0].split(",")
        outputs = self.spec.split("->")[1]
        n_in = len(set(inputs) & set(kernel_axes))  # the kernel's leading axes are contracted with x
        rank = next(c for c in "rzyxw" if c not in self.spec)  # an einsum letter for the rank axis
        tokens = "".join(c for c in inputs if c not in kernel_axes)
        # A as PEFT initialises it (uniform, bound 1 / sqrt(fan_in)); B zero, so the update starts at
        # exactly 0 and step 0 computes the base model's outputs bit for bit.
        a_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=tuple(range(n_in)), out_axis=-1)
        a_names, b_names = (*self.names[:n_in], "lora_rank"), ("lora_rank", *self.names[n_in:])
        a_shape, b_shape = (*self.shape[:n_in], self.lora_rank), (self.lora_rank, *self.shape[n_in:])
        a = self.param("lora_a", nn.with_logical_partitioning(a_init, a_names), a_shape, self.param_dtype)
        b_init = nn.initializers.zeros
        b = self.param("lora_b", nn.with_logical_partitioning(b_init, b_names), b_shape, self.param_dtype)
        if self.lora_dropout and self.has_rng("dropout"):  # training only: evaluation passes no dropout key
            x = nn.Dropout(self.lora_dropout, deterministic=False)(x)
        a, b = self.context.read(a.astype(self.dtype), a_names), self.context.read(b.astype(self.dtype), b_names)
        x = x.astype(self.dtype)
        down = project(f"{inputs},{kernel_axes[:n_in]}{rank}->{tokens}{rank}", x, a, self.cpu_backward)
        down = down * jnp.asarray(self.lora_alpha / self.lora_rank, self.dtype)  # scaled on the narrow side
        return project(f"{tokens}{rank},{rank}{kernel_axes[n_in:]}->{outputs}", down, b, self.cpu_backward)


def adapted_linear(cfg: ModelConfig, peft: PeftConfig, context: TraceContext):
    """Linear with the model's dtypes and the backward pass of the platform traced for; called with `target`
    (q, k, ... down) it gets that projection's LoRA."""
    cpu_backward = uses_cpu_backward(context.platform, cfg.cpu_projection)

    def make(*args, target: str, **kwargs):
        return Linear(
            *args,
            **dtypes(cfg),
            cpu_backward=cpu_backward,
            lora_rank=peft.lora_rank(target),
            lora_alpha=peft.alpha,
            lora_dropout=peft.dropout,
            fp8=cfg.fp8 != "none",
            context=context,
            **kwargs,
        )

    return make


def fp8_input(cfg: ModelConfig, x: jax.Array, tag: str) -> tuple[jax.Array, jax.Array] | None:
    """Under model.fp8, x quantized once for the projections that read it (projection.quantized_input)."""
    return None if cfg.fp8 == "none" else quantized_input(x.astype(jnp.dtype(cfg.compute_dtype)), tag)


class Attention(nn.Module):
    cfg: ModelConfig
    decode: bool = False  # generation: keys/values of earlier tokens come from a cache
    load_balanced: bool = True  # see Llama
    peft: PeftConfig = PeftConfig()
    context: TraceContext = dataclasses.field(default_factory=TraceContext.local)  # see Llama

    @nn.compact
    def __call__(self, x, inputs: LayerInputs):
        cfg = self.cfg
        d, n, kv, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
        linear = adapted_linear(cfg, self.peft, self.context)
        std, out_std = cfg.init_std, output_init_std(cfg)
        constrain = self.context.constrain

        x8 = fp8_input(cfg, x, "attn_norm")
        q = linear("btd,dnh->btnh", (d, n, h), ("embed", "heads", "head_dim"), std, target="q", name="q_proj")(x, x8)
        k = linear("btd,dkh->btkh", (d, kv, h), ("embed", "kv_heads", "head_dim"), std, target="k", name="k_proj")(
            x, x8
        )
        v = linear("btd,dkh->btkh", (d, kv, h), ("embed", "kv_heads", "head_dim"), std, target="v", name="v_proj")(
            x, x8
        )
        q = constrain(checkpoint_name(q, "query_proj"), HEADS)
        k = constrain(checkpoint_name(k, "key_proj"), KV_HEADS)
        v = constrain(checkpoint_name(v, "value_proj"), KV_HEADS)

        q, k = apply_rope(q, inputs.cos, inputs.sin), apply_rope(k, inputs.cos, inputs.sin)
        if self.decode:
            k, v = self.cached(k, v, inputs.positions)  # [batch, cache_len, kv_heads, head_dim]
            context = cached_attention(q, k, v, inputs.positions)
        else:
            implementation = select_implementation(
                cfg.attention, self.context.platform, q.dtype, h, q.shape[1], strict=False
            )
            context = attention(
                q,
                k,
                v,
                inputs.segment_ids,
                implementation,  # [batch, seq, heads, head_dim]
                cfg.attention_max_segments,
                self.load_balanced,
                context=self.context,
            )
        context = constrain(checkpoint_name(context, "attention_context"), HEADS)

        out = linear("btnh,nhd->btd", (n, h, d), ("heads", "head_dim", "embed"), out_std, target="o", name="o_proj")(
            context, fp8_input(cfg, context, "attention_context")
        )
        return checkpoint_name(out, "attention_out")

    def cached(self, k, v, positions):
        """Write this call's keys/values into the cache, at slots = their positions; return the cache.

        The cache is made by `init` with the shape of its input ([batch, cache_len]); a prefill then
        writes a prompt at once and each decode step one token per row, at that row's position.
        """
        creating = not self.has_variable("cache", "key")
        cache_k = self.variable("cache", "key", jnp.zeros, k.shape, k.dtype)
        cache_v = self.variable("cache", "value", jnp.zeros, v.shape, v.dtype)
        if not creating:
            write = jax.vmap(lambda cache, new, start: jax.lax.dynamic_update_slice_in_dim(cache, new, start, 0))
            cache_k.value = self.context.constrain(write(cache_k.value, k, positions[:, 0]), KV_HEADS)
            cache_v.value = self.context.constrain(write(cache_v.value, v, positions[:, 0]), KV_HEADS)
        return cache_k.value, cache_v.value


class MLP(nn.Module):
    cfg: ModelConfig
    peft: PeftConfig = PeftConfig()
    context: TraceContext = dataclasses.field(default_factory=TraceContext.local)  # see Llama

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        d, f = cfg.d_model, cfg.ffn_dim
        linear = adapted_linear(cfg, self.peft, self.context)
        std, out_std = cfg.init_std, output_init_std(cfg)
        x8 = fp8_input(cfg, x, "mlp_norm")
        gate = linear("btd,df->btf", (d, f), ("embed", "mlp"), std, target="gate", name="gate_proj")(x, x8)
        up = linear("btd,df->btf", (d, f), ("embed", "mlp"), std, target="up", name="up_proj")(x, x8)
        gate = self.context.constrain(checkpoint_name(gate, "mlp_gate"), MLP_HIDDEN)
        up = self.context.constrain(checkpoint_name(up, "mlp_up"), MLP_HIDDEN)
        hidden = checkpoint_name(nn.silu(gate) * up, "mlp_hidden")  # SwiGLU
        out = linear("btf,fd->btd", (f, d), ("mlp", "embed"), out_std, target="down", name="down_proj")(
            hidden, fp8_input(cfg, hidden, "mlp_hidden")
        )
        return checkpoint_name(out, "mlp_out")


class Block(nn.Module):
    """One pre-norm transformer layer. Signature fits nn.scan: (carry, broadcast) -> (carry, None); every way of
    running the stack (stack/) gives it the same LayerInputs."""

    cfg: ModelConfig
    decode: bool = False
    load_balanced: bool = True  # see Llama
    peft: PeftConfig = PeftConfig()
    # see Llama; inside a pipeline stage, the stage's (Stack.inside_stage)
    context: TraceContext = dataclasses.field(default_factory=TraceContext.local)

    @nn.compact
    def __call__(self, x, inputs: LayerInputs):
        cfg, constrain = self.cfg, self.context.constrain
        norm = partial(RMSNorm, eps=cfg.norm_eps, **dtypes(cfg))
        h = checkpoint_name(norm(name="attn_norm")(x), "attn_norm")
        h = constrain(h, HIDDEN)
        attention = Attention(cfg, self.decode, self.load_balanced, self.peft, self.context, name="attn")
        x = x + attention(h, inputs)
        x = constrain(x, RESIDUAL)
        h = checkpoint_name(norm(name="mlp_norm")(x), "mlp_norm")
        h = constrain(h, HIDDEN)
        x = x + MLP(cfg, self.peft, self.context, name="mlp")(h)
        x = constrain(x, RESIDUAL)
        return x, None


class PromptEncoder(nn.Module):
    """P-tuning's virtual tokens [prompt_tokens, embed]: learned inputs passed through an MLP, or through a
    bidirectional LSTM and then the MLP (Liu et al. 2021), so that the tokens of a prompt are trained
    together rather than each on its own. After training only the output is kept (peft.inference_params)."""

    cfg: ModelConfig
    peft: PeftConfig

    @nn.compact
    def __call__(self) -> jax.Array:
        cfg, peft = self.cfg, self.peft
        hidden, param_dtype = peft.encoder_hidden or cfg.d_model, jnp.dtype(cfg.param_dtype)
        named = nn.with_logical_partitioning
        x = self.param(
            "embedding",
            init_normal(cfg.init_std, ("virtual_tokens", "embed")),
            (peft.prompt_tokens, cfg.d_model),
            param_dtype,
        )
        features: str | None = "embed"  # the logical name of x's last axis
        if peft.prompt_encoder == "lstm":

            def lstm(direction: str):
                return nn.RNN(
                    nn.OptimizedLSTMCell(
                        hidden,
                        param_dtype=param_dtype,
                        name=f"{direction}_lstm",
                        kernel_init=named(nn.initializers.lecun_normal(), ("embed", "prompt_hidden")),
                        recurrent_kernel_init=named(nn.initializers.orthogonal(), ("prompt_hidden", None)),
                        bias_init=named(nn.initializers.zeros, ("prompt_hidden",)),
                    )
                )

            x = nn.Bidirectional(lstm("forward"), lstm("backward"))(x[None])[0]  # [prompt_tokens, 2 x hidden]
            features = None  # both directions' hidden states: not named again (a name appears once per array)

        def dense(width: int, names: tuple[str, str], name: str) -> nn.Dense:
            return nn.Dense(
                width,
                param_dtype=param_dtype,
                kernel_init=named(nn.initializers.lecun_normal(), names),
                bias_init=named(nn.initializers.zeros, names[1:]),
                name=name,
            )

        x = nn.relu(dense(hidden, (features, "prompt_hidden"), "hidden")(x))
        return dense(cfg.d_model, ("prompt_hidden", "embed"), "output")(x)


def embedding_table(cfg: ModelConfig) -> nn.Embed:
    """The token embedding [vocab, embed], made by the module whose method calls this (Llama's "embed")."""
    return nn.Embed(
        cfg.vocab_size,
        cfg.d_model,
        embedding_init=init_normal(cfg.init_std, ("vocab", "embed")),
        **dtypes(cfg),
        name="embed",
    )


class Llama(nn.Module):
    cfg: ModelConfig
    remat_config: RematConfig = RematConfig()
    decode: bool = False  # generation with a key/value cache (the "cache" collection), see generate.py
    # How a sequence split over the mesh's `sequence` axis is laid out (mesh.load_balance): early and
    # late chunks paired per device (sharding.balance_sequence) or in order. Causal attention needs to
    # know which keys come before which queries; positions restart per document and cannot tell.
    load_balanced: bool = True
    peft: PeftConfig = PeftConfig()  # adapters: LoRA in the projections, or a learned prompt
    # Training under pipeline parallelism (mesh.pipeline > 1): the layers run as stages over micro-batches.
    pipeline: PipelineLayout | None = None
    # What the trace is for: the platform whose kernels run, the mesh and the logical-axis rules (context.py).
    # TrainProgram passes its mesh's; by default this process's platform, no mesh, no rules.
    context: TraceContext = dataclasses.field(default_factory=TraceContext.local)

    @nn.compact
    def __call__(self, tokens, positions=None, segment_ids=None, targets=None, loss_mask=None):
        """tokens [batch, seq] int -> logits [batch, seq, vocab] in the compute dtype; or, given
        targets [batch, seq] (and loss_mask), the summed next-token loss and its token count (fp32).

        positions restart at 0 for every packed document and segment_ids (>= 1 per document) keep
        documents from attending to each other; without them the row is one document. With
        decode=True, tokens at `positions` attend to every cached token at earlier positions.
        """
        cfg = self.cfg
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        if targets is not None and loss_mask is None:
            loss_mask = jnp.ones(targets.shape, jnp.float32)
        embed = embedding_table(cfg)  # Llama's child "embed": the output projection too when tied
        x = self.embeddings(embed, tokens)  # [batch, seq, embed]
        stack, head = self.stack(), self.head(embed)
        # The layers' params [n_layers, ...], Block under nn.scan (stack/scan.py): every way runs these.
        layers = scanned(Block, cfg.n_layers, stack)(
            cfg, self.decode, self.load_balanced, self.peft, self.context, name="layers"
        )
        if targets is not None and stack.computes_loss:  # 1F1B: each micro-batch's loss on the pipeline's last stage
            loss = Head(partial(final_loss, cfg), head, targets, loss_mask)
            return run_stack(stack, layers, x, segment_ids, positions, loss), jnp.sum(loss_mask)
        x = run_stack(stack, layers, x, segment_ids, positions, dropout_key=self.dropout_key())
        x = rms_norm(x, head["norm"], cfg.norm_eps, jnp.dtype(cfg.compute_dtype))  # the final norm
        if targets is not None:  # training and evaluation: the logits never exist as a whole
            return next_token_loss(x, head["output"].astype(cfg.compute_dtype), targets, loss_mask, self.context)
        output = self.context.read(head["output"].astype(cfg.compute_dtype), OUTPUT_WEIGHT)
        cpu_backward = uses_cpu_backward(self.context.platform, cfg.cpu_projection)
        return self.context.constrain(project("btd,dv->btv", x, output, cpu_backward), LOGITS)

    def embeddings(self, embed: nn.Embed, tokens: jax.Array) -> jax.Array:
        """[batch, seq, embed]: each token's row of the table; at a learned prompt's slots, the prompt's."""
        table = self.context.read(embed.embedding.astype(self.cfg.compute_dtype), ("vocab", "embed"))
        x = lookup(table, jnp.maximum(tokens, 0), self.context)  # = embed(tokens), reading the table as `read` says
        if self.peft.virtual_tokens:
            x = jnp.where(tokens[..., None] < 0, self.virtual_embeddings(tokens).astype(x.dtype), x)
        return self.context.constrain(x, RESIDUAL)

    def stack(self) -> Stack:
        """How the layers run (stack/): under nn.scan, in groups of recomputation, or as pipeline stages; every
        way applies one Block to the same LayerInputs."""
        return Stack(
            block=Block(self.cfg, load_balanced=self.load_balanced, peft=self.peft, context=self.context, parent=None),
            inputs=partial(layer_inputs, self.cfg),
            names=RESIDUAL,
            context=self.context,
            policy=remat.checkpoint_policy(self.remat_config),
            every_n=self.remat_config.every_n_layers,
            pipeline=self.pipeline,
        )

    def head(self, embed: nn.Embed) -> dict[str, jax.Array]:
        """The params after the layers: the final norm's scale [embed] and the output projection [embed, vocab]."""
        return {
            "norm": NormScale(self.cfg.d_model, jnp.dtype(self.cfg.param_dtype), name="final_norm")(),
            "output": self.output_weight(embed),
        }

    def dropout_key(self) -> jax.Array | None:
        """LoRA's dropout key, training a peft run, for the ways that apply the layers themselves (stack/)."""
        return self.make_rng("dropout") if self.peft.dropout and self.has_rng("dropout") else None

    def output_weight(self, embed: nn.Embed) -> jax.Array:
        """[embed, vocab] the output projection: the embedding table, transposed, when tied."""
        if self.cfg.tie_embeddings:
            return embed.embedding.T
        return Weight(
            (self.cfg.d_model, self.cfg.vocab_size),
            OUTPUT_WEIGHT,
            self.cfg.init_std,
            self.cfg.param_dtype,
            name="lm_head",
        )()

    def virtual_embeddings(self, tokens: jax.Array) -> jax.Array:
        """[batch, seq, embed]: at every prompt slot its learned embedding (elsewhere: to be ignored).

        The loader leaves peft.prompt_tokens slots in front of every document (data/loader.py), holding
        token ids -1, -2, ...: slot k takes row k of the prompt, at the positions 0..k of its document.
        """
        cfg, peft = self.cfg, self.peft
        if peft.method == "ptuning":
            prompt = PromptEncoder(cfg, peft, name="prompt_encoder")()
        else:
            init = init_normal(cfg.init_std, ("virtual_tokens", "embed"))
            prompt = nn.Embed(
                peft.prompt_tokens,
                cfg.d_model,
                param_dtype=jnp.dtype(cfg.param_dtype),
                embedding_init=init,
                name="prompt",
            ).embedding
        return jnp.take(prompt, jnp.clip(-tokens - 1, 0, peft.prompt_tokens - 1), axis=0)


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
# Sizes and FLOPs
# abstract_params' traces (one of the model's init, asked for several times per run), by the configs' exact repr.
_ABSTRACT_PARAMS: dict[str, Any] = {}


def abstract_params(cfg: ModelConfig, peft: PeftConfig = PeftConfig()):
    """Shapes (with logical axis names) of the params (with `peft`'s adapters), without allocating them."""
    key = repr((cfg, peft))
    if key not in _ABSTRACT_PARAMS:
        if len(_ABSTRACT_PARAMS) >= 64:  # a sweep: many configs, each traced rarely
            _ABSTRACT_PARAMS.clear()
        tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
        _ABSTRACT_PARAMS[key] = jax.eval_shape(Llama(cfg, peft=peft).init, jax.random.key(0), tokens)["params"]
    return _ABSTRACT_PARAMS[key]


def param_shapes(cfg: ModelConfig, peft: PeftConfig = PeftConfig()):
    """abstract_params' ShapeDtypeStructs without their logical names (not nn.meta.unbox: inside a mesh context
    it applies sharding constraints, which ShapeDtypeStructs cannot take)."""
    boxed = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731
    return jax.tree.map(
        lambda x: x.unbox(apply_constraint=False) if boxed(x) else x, abstract_params(cfg, peft), is_leaf=boxed
    )


def param_count(cfg: ModelConfig) -> int:
    leaves = jax.tree.leaves(param_shapes(cfg))
    return sum(int(np.prod(leaf.shape)) for leaf in leaves)
