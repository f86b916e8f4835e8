"""Blocked causal attention in plain JAX (the FlashAttention algorithm), for where cuDNN is not:
CPUs, and GPUs without cuDNN's fused kernel.

The sequence is cut into blocks of queries and keys. A query block visits only the key blocks at or
before it (the causal mask makes the others all zero, so they are skipped: about half the work of the
full T x T product), keeping a running maximum and sum of its softmax ("online softmax"), so the
[T, T] scores never exist as a whole. The backward pass (custom_vjp) recomputes each block's
probabilities from the saved log-sum-exp instead of keeping them, so the memory a layer keeps for
attention is its output and one number per query, not [heads, T, T].

Written by hand because no kept library has it for CPU: jax.nn.dot_product_attention's XLA path
materialises and saves the full probability matrix, and its cuDNN path needs an NVIDIA GPU.
Layout as jax.nn.dot_product_attention: q [b, t, heads, h], k/v [b, t, kv_heads, h]; grouped-query
attention when heads is a multiple of kv_heads. Tokens must be in order (no context parallelism).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Blocks are multiples of 64 tokens; sequences shorter than MIN_SEQ run unblocked (XLA's attention).
# The `bench` preset's 512 tokens in 8 blocks of 64 (36 of the 64 block pairs) ran its fp32 forward +
# backward on a 2-core CPU in 66 ms against 81 ms in 4 blocks of 128 (bench/attention.py --blocks).
MIN_BLOCK = 64
MIN_SEQ = 256
MAX_BLOCKS = 8  # longer sequences get longer blocks: at most 8 x 9 / 2 = 36 block pairs to compile
NEG = -1e30  # "minus infinity" that keeps exp() and subtraction finite


def block_size(seq_len: int) -> int | None:
    """The block length for a sequence, or None when blocking does not apply (short or indivisible)."""
    block = max(MIN_BLOCK, -(-seq_len // MAX_BLOCKS))
    block = -(-block // MIN_BLOCK) * MIN_BLOCK
    if seq_len < MIN_SEQ or seq_len % block:
        return None
    return block


def blocked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, block: int | None = None
) -> jax.Array:
    """Causal attention (with document masking when segment_ids is given) -> [b, t, heads, h], in blocks of
    `block` tokens (default: block_size's; bench/attention.py compares others)."""
    block = block or block_size(q.shape[1])
    if block is None or q.shape[1] % block:
        raise ValueError(
            f"blocked attention needs a sequence of at least {MIN_SEQ} tokens that its block "
            f"size divides, got {q.shape[1]}"
        )
    if segment_ids is None:
        segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    return _attention(q, k, v, segment_ids, block)


def _split(q, k, v, block):
    """[b, t, n, h] -> query blocks [b, kv, blk * g, h] (a block's rows: its tokens' g query heads that share a
    key head, token by token) and key/value blocks [b, kv, blk, h]. Grouped heads share one matmul of g x the
    rows, which XLA:CPU runs faster than g small ones."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    rows = block * (n // kv)
    qs = q.reshape(b, t, kv, n // kv, h).transpose(0, 2, 1, 3, 4).reshape(b, kv, -1, h)  # [b, kv, t * g, h]
    ks, vs = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [b, kv, t, h]
    nb = t // block
    return (
        [qs[:, :, i * rows : (i + 1) * rows] for i in range(nb)],
        [ks[:, :, i * block : (i + 1) * block] for i in range(nb)],
        [vs[:, :, i * block : (i + 1) * block] for i in range(nb)],
    )


def _merge(blocks, heads: int):
    """_split's query blocks (their tokens' rows) -> [b, t, heads, h]."""
    x = jnp.concatenate(blocks, axis=2)  # [b, kv, t * g, h]
    b, kv, rows, h = x.shape
    t = rows * kv // heads
    return x.reshape(b, kv, t, heads // kv, h).transpose(0, 2, 1, 3, 4).reshape(b, t, heads, h)


def _mask(segments, i, j, block, groups):
    """[b, 1, blk * g, blk] visibility of key block j to query block i (j <= i), repeated for each token's g
    query heads."""
    sq = segments[:, i * block : (i + 1) * block]
    sk = segments[:, j * block : (j + 1) * block]
    visible = sq[:, :, None] == sk[:, None, :]
    if i == j:
        visible &= jnp.tril(jnp.ones((block, block), bool))
    b = visible.shape[0]
    return jnp.broadcast_to(visible[:, :, None], (b, block, groups, block)).reshape(b, 1, block * groups, block)


def _scores(qi, kj, scale):
    return jnp.einsum("bkqh,bksh->bkqs", qi, kj, preferred_element_type=jnp.float32) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segments, block):
    return _forward(q, k, v, segments, block)[0]


def _forward(q, k, v, segments, block):
    n, h = q.shape[2:]
    scale = h**-0.5
    qs, ks, vs = _split(q, k, v, block)
    outs, lses = [], []
    for i, qi in enumerate(qs):
        m = jnp.full(qi.shape[:-1], NEG, jnp.float32)
        row_sum = jnp.zeros(qi.shape[:-1], jnp.float32)  # the softmax denominator, at the running max m
        acc = jnp.zeros(qi.shape, jnp.float32)
        for j in range(i + 1):  # key blocks after the query block are entirely in the future: skipped
            visible = _mask(segments, i, j, block, n // k.shape[2])
            s = jnp.where(visible, _scores(qi, ks[j], scale), NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            row_sum = row_sum * correction + p.sum(-1)
            acc = acc * correction[..., None] + jnp.einsum(
                "bkqs,bksh->bkqh", p.astype(v.dtype), vs[j], preferred_element_type=jnp.float32
            )
            m = m_new
        outs.append(acc / row_sum[..., None])
        lses.append(m + jnp.log(row_sum))
    result = _merge(outs, n).astype(q.dtype)
    return result, (q, k, v, segments, result, jnp.concatenate(lses, axis=2))  # log-sum-exps [b, kv, t * g]


def _forward_rule(q, k, v, segments, block):
    return _forward(q, k, v, segments, block)


def _backward_rule(block, residuals, d_out):
    q, k, v, segments, out, lse = residuals
    n, h = q.shape[2:]
    scale = h**-0.5
    qs, ks, vs = _split(q, k, v, block)
    to_blocks = lambda x: _split(x, k, v, block)[0]  # noqa: E731 - same layout as the queries
    d_outs, outs = to_blocks(d_out), to_blocks(out)
    nb = len(qs)
    dq = [jnp.zeros(x.shape, jnp.float32) for x in qs]
    dk = [jnp.zeros(x.shape, jnp.float32) for x in ks]
    dv = [jnp.zeros(x.shape, jnp.float32) for x in vs]
    for i in range(nb):
        rows = qs[i].shape[2]
        lse_i = lse[:, :, i * rows : (i + 1) * rows]
        delta = jnp.sum(d_outs[i].astype(jnp.float32) * outs[i].astype(jnp.float32), axis=-1)  # [b, kv, blk * g]
        for j in range(i + 1):
            visible = _mask(segments, i, j, block, n // k.shape[2])
            p = jnp.where(visible, jnp.exp(_scores(qs[i], ks[j], scale) - lse_i[..., None]), 0.0)
            dv[j] += jnp.einsum("bkqs,bkqh->bksh", p.astype(d_out.dtype), d_outs[i], preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkqh,bksh->bkqs", d_outs[i], vs[j], preferred_element_type=jnp.float32)
            ds = p * (dp - delta[..., None]) * scale
            dq[i] += jnp.einsum("bkqs,bksh->bkqh", ds.astype(q.dtype), ks[j], preferred_element_type=jnp.float32)
            dk[j] += jnp.einsum("bkqs,bkqh->bksh", ds.astype(q.dtype), qs[i], preferred_element_type=jnp.float32)
    dq_all = _merge(dq, n).astype(q.dtype)
    dk_all = jnp.concatenate(dk, axis=2).transpose(0, 2, 1, 3).astype(k.dtype)
    dv_all = jnp.concatenate(dv, axis=2).transpose(0, 2, 1, 3).astype(v.dtype)
    return dq_all, dk_all, dv_all, None


_attention.defvjp(_forward_rule, _backward_rule)
