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

MIN_BLOCK = 128
MAX_BLOCKS = 8  # longer sequences get longer blocks: at most 8 x 9 / 2 = 36 block pairs to compile
NEG = -1e30  # "minus infinity" that keeps exp() and subtraction finite


def block_size(seq_len: int) -> int | None:
    """The block length for a sequence, or None when blocking does not apply (short or indivisible)."""
    block = max(MIN_BLOCK, -(-seq_len // MAX_BLOCKS))
    block = -(-block // MIN_BLOCK) * MIN_BLOCK  # a multiple of 128
    if seq_len < 2 * MIN_BLOCK or seq_len % block:
        return None
    return block


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Causal attention (with document masking when segment_ids is given) -> [b, t, heads, h]."""
    block = block_size(q.shape[1])
    if block is None:
        raise ValueError(
            f"blocked attention needs a sequence of at least {2 * MIN_BLOCK} tokens that its block "
            f"size divides, got {q.shape[1]}"
        )
    if segment_ids is None:
        segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    return _attention(q, k, v, segment_ids, block)


def _split(q, k, v, block):
    """[b, t, n, h] -> query blocks [b, kv, g, blk, h] and key/value blocks [b, kv, blk, h]."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    qs = q.reshape(b, t, kv, n // kv, h).transpose(0, 2, 3, 1, 4)  # [b, kv, g, t, h]
    ks, vs = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [b, kv, t, h]
    nb = t // block
    return (
        [qs[:, :, :, i * block : (i + 1) * block] for i in range(nb)],
        [ks[:, :, i * block : (i + 1) * block] for i in range(nb)],
        [vs[:, :, i * block : (i + 1) * block] for i in range(nb)],
    )


def _mask(segments, i, j, block):
    """[b, 1, 1, blk_q, blk_k] visibility of key block j to query block i (j <= i)."""
    sq = segments[:, i * block : (i + 1) * block]
    sk = segments[:, j * block : (j + 1) * block]
    visible = sq[:, :, None] == sk[:, None, :]
    if i == j:
        visible &= jnp.tril(jnp.ones((block, block), bool))
    return visible[:, None, None]


def _scores(qi, kj, scale):
    return jnp.einsum("bkgqh,bksh->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segments, block):
    return _forward(q, k, v, segments, block)[0]


def _forward(q, k, v, segments, block):
    b, t, n, h = q.shape
    scale = h**-0.5
    qs, ks, vs = _split(q, k, v, block)
    outs, lses = [], []
    for i, qi in enumerate(qs):
        m = jnp.full(qi.shape[:-1], NEG, jnp.float32)
        row_sum = jnp.zeros(qi.shape[:-1], jnp.float32)  # the softmax denominator, at the running max m
        acc = jnp.zeros(qi.shape, jnp.float32)
        for j in range(i + 1):  # key blocks after the query block are entirely in the future: skipped
            visible = _mask(segments, i, j, block)
            s = jnp.where(visible, _scores(qi, ks[j], scale), NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            row_sum = row_sum * correction + p.sum(-1)
            acc = acc * correction[..., None] + jnp.einsum(
                "bkgqs,bksh->bkgqh", p.astype(v.dtype), vs[j], preferred_element_type=jnp.float32
            )
            m = m_new
        outs.append(acc / row_sum[..., None])
        lses.append(m + jnp.log(row_sum))
    out = jnp.concatenate(outs, axis=3)  # [b, kv, g, t, h]
    lse = jnp.concatenate(lses, axis=3)  # [b, kv, g, t]
    result = out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)
    return result, (q, k, v, segments, result, lse)


def _forward_rule(q, k, v, segments, block):
    return _forward(q, k, v, segments, block)


def _backward_rule(block, residuals, d_out):
    q, k, v, segments, out, lse = residuals
    b, t, n, h = q.shape
    scale = h**-0.5
    qs, ks, vs = _split(q, k, v, block)
    to_blocks = lambda x: _split(x, k, v, block)[0]  # noqa: E731 - same layout as the queries
    d_outs, outs = to_blocks(d_out), to_blocks(out)
    nb = len(qs)
    dq = [jnp.zeros(x.shape, jnp.float32) for x in qs]
    dk = [jnp.zeros(x.shape, jnp.float32) for x in ks]
    dv = [jnp.zeros(x.shape, jnp.float32) for x in vs]
    for i in range(nb):
        lse_i = lse[:, :, :, i * block : (i + 1) * block]
        delta = jnp.sum(d_outs[i].astype(jnp.float32) * outs[i].astype(jnp.float32), axis=-1)  # [b, kv, g, blk]
        for j in range(i + 1):
            visible = _mask(segments, i, j, block)
            p = jnp.where(visible, jnp.exp(_scores(qs[i], ks[j], scale) - lse_i[..., None]), 0.0)
            dv[j] += jnp.einsum(
                "bkgqs,bkgqh->bksh", p.astype(d_out.dtype), d_outs[i], preferred_element_type=jnp.float32
            )
            dp = jnp.einsum("bkgqh,bksh->bkgqs", d_outs[i], vs[j], preferred_element_type=jnp.float32)
            ds = p * (dp - delta[..., None]) * scale
            dq[i] += jnp.einsum("bkgqs,bksh->bkgqh", ds.astype(q.dtype), ks[j], preferred_element_type=jnp.float32)
            dk[j] += jnp.einsum("bkgqs,bkgqh->bksh", ds.astype(q.dtype), qs[i], preferred_element_type=jnp.float32)
    dq_all = jnp.concatenate(dq, axis=3).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)
    dk_all = jnp.concatenate(dk, axis=2).transpose(0, 2, 1, 3).astype(k.dtype)
    dv_all = jnp.concatenate(dv, axis=2).transpose(0, 2, 1, 3).astype(v.dtype)
    return dq_all, dk_all, dv_all, None


_attention.defvjp(_forward_rule, _backward_rule)
