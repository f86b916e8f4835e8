"""The next-token loss, fused with the output projection and computed over chunks of tokens.

The plain formula projects the final hidden states to logits, [batch, seq, vocab], and takes their
log-softmax. With Llama 3's 128,256-token vocabulary those logits are ~4 GB per 8K sequence in fp32,
and autodiff keeps them (and a mask of the same shape) for the backward pass. Here the projection and
the loss run together over chunks of tokens, so one chunk's logits exist at a time; and because the
summed loss is the last thing the program computes, its cotangent is one scalar that only scales the
gradient: each chunk's gradients with respect to the hidden states and the output weight are computed
while its logits are at hand (the idea of Liger-Kernel's fused linear cross-entropy). The backward
pass then keeps dx [batch, seq, embed] and dW [embed, vocab], never [batch, seq, vocab], and no
logits are computed twice.

Works with the vocabulary sharded over `tensor`: the log-sum-exp and the target logit are reductions
over the vocab axis (each device reduces its slice, XLA adds the partial results) rather than a gather.
Written by hand because no kept library does this in JAX for CPU and GPU alike.

Sharded over the batch (FSDP, data parallelism) or the sequence, the loop over chunks would communicate in
every chunk: XLA gathered the output weight again for each, and reduce-scattered each chunk's dW, a partial
sum over one device's tokens, in fp32. For Llama 3 8B's 8K stage on 32 H100s (16 micro-batches of 8 chunks)
that was 128 gathers of 1 GB and 128 reduce-scatters of 2.1 GB a step: a third of the step's collective
traffic (plan: 1,044 GB per GPU and step, 702 GB without). The caller gathers the weight once
(TraceContext.gathered), and the chunks' dW stay one partial sum per device, [batch shards, sequence shards,
embed, vocab], added across devices once, after the loop, straight into the weight's sharding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from llama_jax.model.context import with_logical_constraint

CHUNK_TOKENS = 1024  # tokens of each row per chunk: [batch, 1024, vocab] fp32 logits at a time
LOGITS = ("batch", "seq", "act_vocab")
OUTPUT_WEIGHT = ("embed", "vocab")  # the output projection's logical axes (the embedding table's, transposed)
# dW's partial sums, one per device: [batch shards, sequence shards, embed, vocab]
WEIGHT_GRADIENT_BY_SHARD = ("batch", "seq", None, "act_vocab")


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The plain formula from logits: summed next-token NLL over unmasked targets, and their count."""
    logits = logits.astype(jnp.float32)
    nll = jax.nn.logsumexp(logits, axis=-1) - _target_logits(logits, targets)
    return jnp.sum(nll * mask), jnp.sum(mask)


def fused_cross_entropy_sum(
    x: jax.Array,
    weight: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    rules: tuple = (),
    token_shards: tuple[int, int] = (1, 1),
) -> tuple[jax.Array, jax.Array]:
    """cross_entropy_sum(x @ weight, targets, mask) without the [batch, seq, vocab] logits.

    x [batch, seq, embed] final hidden states, weight [embed, vocab] (the transposed embedding table
    when tied; gathered over the batch's and sequence's mesh axes: TraceContext.gathered), targets [batch, seq]
    int, mask [batch, seq] float. rules: the trace's logical-axis rules (TraceContext.rules), which shard each
    chunk's logits; () leaves them to XLA. token_shards: the devices splitting x's batch and its sequence
    (TraceContext.token_shards), each keeping its own partial dW.
    """
    chunks = chunk_count(x.shape[1])
    batch, tokens = x.shape[0], x.shape[1] // chunks
    shards = tuple(n if size % n == 0 else 1 for n, size in zip(token_shards, (batch, tokens), strict=True))
    return _fused(x, weight, targets, mask.astype(jnp.float32), chunks, rules, shards), jnp.sum(mask)


def chunk_count(seq_len: int) -> int:
    """The fewest chunks, dividing seq_len, with at most CHUNK_TOKENS tokens of a row in each."""
    return next(n for n in range(1, seq_len + 1) if seq_len % n == 0 and seq_len // n <= CHUNK_TOKENS)


def _target_logits(logits, targets):
    # A masked sum rather than a gather: with the vocab split over `tensor` each device sums its own
    # slice, instead of gathering the logits.
    vocab_ids = jnp.arange(logits.shape[-1], dtype=targets.dtype)
    return jnp.sum(jnp.where(vocab_ids == targets[..., None], logits, 0.0), axis=-1)


def _by_chunk(a: jax.Array, chunks: int) -> jax.Array:
    """[batch, seq, ...] -> [chunks, batch, seq / chunks, ...]; chunk c holds tokens c, c + chunks, ...

    Strided rather than contiguous chunks keep a sequence-sharded axis sharded the same way inside
    every chunk (the loss is a sum over tokens, so their order does not matter).
    """
    b, t = a.shape[:2]
    return jnp.moveaxis(a.reshape(b, t // chunks, chunks, *a.shape[2:]), 2, 0)


def _chunks(x, targets, mask, chunks: int):
    return _by_chunk(x, chunks), _by_chunk(targets, chunks), _by_chunk(mask, chunks)


def _chunk_loss(x_c, weight, targets_c, mask_c, rules: tuple):
    """One chunk's fp32 logits [batch, seq / chunks, vocab], their log-sum-exp and its summed loss."""
    logits = with_logical_constraint(
        jnp.einsum("btd,dv->btv", x_c, weight, preferred_element_type=jnp.float32), LOGITS, rules
    )
    lse = jax.nn.logsumexp(logits, axis=-1)
    return logits, lse, jnp.sum((lse - _target_logits(logits, targets_c)) * mask_c)


def _weight_gradient_by_shard(x_c, d_logits, shards: tuple[int, int], rules: tuple):
    """A chunk's x^T d_logits as one partial sum per device, [batch shards, sequence shards, embed, vocab]: the
    batch and token axes split by their shards, and only each shard's own tokens contracted, so no device
    exchanges anything."""
    batch_shards, seq_shards = shards
    b, t = x_c.shape[:2]
    x_s, d_s = (a.reshape(batch_shards, b // batch_shards, seq_shards, t // seq_shards, -1) for a in (x_c, d_logits))
    partial = jnp.einsum("sbqtd,sbqtv->sqdv", x_s, d_s, preferred_element_type=jnp.float32)
    return with_logical_constraint(partial, WEIGHT_GRADIENT_BY_SHARD, rules)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused(x, weight, targets, mask, chunks, rules, shards):
    def add_chunk_loss(total, chunk):
        x_c, targets_c, mask_c = chunk
        return total + _chunk_loss(x_c, weight, targets_c, mask_c, rules)[2], None

    return jax.lax.scan(add_chunk_loss, jnp.zeros((), jnp.float32), _chunks(x, targets, mask, chunks))[0]


def _fused_forward(x, weight, targets, mask, chunks, rules, shards):
    def chunk_loss_and_grads(carry, chunk):
        total, d_weight = carry
        x_c, targets_c, mask_c = chunk
        logits, lse, loss = _chunk_loss(x_c, weight, targets_c, mask_c, rules)
        # d(loss)/d(logits) = softmax - one_hot(target), for unmasked tokens
        vocab_ids = jnp.arange(logits.shape[-1], dtype=targets_c.dtype)
        d_logits = (jnp.exp(logits - lse[..., None]) - (vocab_ids == targets_c[..., None])) * mask_c[..., None]
        d_logits = with_logical_constraint(d_logits.astype(x.dtype), LOGITS, rules)
        d_x = jnp.einsum("btv,dv->btd", d_logits, weight, preferred_element_type=jnp.float32).astype(x.dtype)
        d_weight = d_weight + _weight_gradient_by_shard(x_c, d_logits, shards, rules)
        return (total + loss, d_weight), d_x

    by_shard = jnp.zeros((*shards, *weight.shape), jnp.float32)
    zeros = (jnp.zeros((), jnp.float32), with_logical_constraint(by_shard, WEIGHT_GRADIENT_BY_SHARD, rules))
    (total, d_weight), d_x = jax.lax.scan(chunk_loss_and_grads, zeros, _chunks(x, targets, mask, chunks))
    b, t = x.shape[:2]
    d_x = jnp.moveaxis(d_x, 0, 2).reshape(b, t, x.shape[2])  # back from chunks to the token order
    # The devices' partial sums added once, straight into the weight's own sharding: a reduce-scatter.
    d_weight = with_logical_constraint(d_weight.sum((0, 1)), OUTPUT_WEIGHT, rules)
    return total, (d_x, d_weight.astype(weight.dtype))


def _fused_backward(chunks, rules, shards, residuals, d_total):
    d_x, d_weight = residuals
    # The loss is linear in its cotangent: the gradients computed in the forward pass, scaled.
    return (d_x * d_total).astype(d_x.dtype), (d_weight * d_total).astype(d_weight.dtype), None, None


_fused.defvjp(_fused_forward, _fused_backward)
