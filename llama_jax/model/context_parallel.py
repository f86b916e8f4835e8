"""Context parallelism: causal attention when the mesh splits the sequence over its `sequence` axis.

Every device keeps its slice of the queries and all-gathers the keys and values of the whole sequence
(Llama 3's scheme for its 128K context; autodiff turns the gathers into reduce-scatters of the key and
value gradients). With mesh.load_balance the slice is two chunks, i and 2s-1-i of 2s
(sharding.balance_sequence), so that every device does the same causal work; otherwise it is chunk i of s.

A chunk of queries needs three kinds of keys, and this module computes only the first two:

  - its own chunk's keys, causally (the diagonal block): any in-order kernel, cuDNN's packed layout included;
  - earlier chunks' keys that its *first* document reaches back to (the visible prefix): documents are
    contiguous runs of a row, so only the document holding the chunk's first token can cross the chunk's
    start, and its queries (rows [0, a) of the chunk) see every key of that document before the chunk
    unmasked. The prefix is one rectangle of the gathered keys, rolled so that it starts at index 0;
  - later chunks' keys: all in the future, never touched.

Rows [0, a) therefore combine two partial attentions (the causal block of their own rows and the prefix)
by their softmax log-sum-exp; the other rows are finished by the in-chunk kernel alone. Both partial
attentions are "padded" attention with per-row lengths, which cuDNN runs without any mask tensor and
skipping the padding; here it is written as a kernel interface (forward -> output and log-sum-exp;
backward from the *combined* output and log-sum-exp, as FlashAttention's backward of a split softmax
needs) with two implementations: cuDNN's (cudnn.PADDED_KERNEL) and an XLA one for CPUs and tests.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

SEQUENCE_AXIS = "sequence"
# The name of the conditional that picks what a chunk computes by where its documents start (chunk_attention), in
# the compiled program: its branches are the chunk alone, its first document's prefix, and both. With one document
# per row every chunk but the sequence's first takes the second, so the step waits on devices that run it for
# both their chunks; `plan`'s step prediction prices that branch (hlo.analyze's branch_runs).
CHUNK_CHOICE_SCOPE = "context_parallel_chunk_by_documents"
# The name of the prefix's kernel calls (a chunk's first document against its keys in earlier chunks): their keys
# are the whole gathered sequence, padded past the prefix, which cuDNN skips at run time, so the compiled call's
# shape overstates the work; `plan` prices the share one document per row uses (hlo.analyze's work_shares).
PREFIX_SCOPE = "context_parallel_prefix"


# ---------------------------------------------------------------------------------------------
# Where each chunk of the sequence lives


def chunk_order(shards: int, balanced: bool) -> list[int]:
    """The sequence's chunks in the order the devices hold them (device 0's first): with balancing,
    device i holds chunks i and 2·shards-1-i of 2·shards; without, chunk i of `shards`."""
    if not balanced:
        return list(range(shards))
    return [c for i in range(shards) for c in (i, 2 * shards - 1 - i)]


def _to_token_order(x: jax.Array, order: list[int]) -> jax.Array:
    """[b, t, ...] gathered in device order -> the same tokens in sequence order."""
    chunks = jnp.split(x, len(order), axis=1)
    return jnp.concatenate([chunks[order.index(c)] for c in range(len(order))], axis=1)


def _document_starts(segment_ids: jax.Array) -> jax.Array:
    """[b, t] -> [b, t] bool: the token begins a document (a run of equal segment ids)."""
    first = jnp.ones_like(segment_ids[:, :1], dtype=bool)
    return jnp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


# ---------------------------------------------------------------------------------------------
# The kernel interface, and its XLA implementation


@dataclass(frozen=True)
class PaddedKernel:
    """Attention where query i < q_len[row] sees keys j < kv_len[row] (and j <= i when causal).

    forward(q, k, v, q_len, kv_len, causal) -> (out [b, tq, n, h], lse [b, n, tq] fp32 natural log of
    the scaled scores' sum of exponentials); rows past q_len are left unspecified.
    backward(q, k, v, q_len, kv_len, causal, out, lse, d_out) -> (dq, dk, dv), where out and lse are
    those of the *combined* attention the part belongs to. kv_len must be >= 1.
    """

    forward: Callable
    backward: Callable


# The XLA kernel's queries per pass: the scores of one pass, [queries, keys] per head, are what it holds (a CPU's
# memory and `plan`'s XLA:CPU proxy; cuDNN's kernel holds no scores at all). llama3_405b's 128K stage on the
# proxy's 512 devices: 913.94 GiB per device with all of a chunk's queries at once, 237.29 in passes of 256,
# 200.54 of 64, 191.25 of 16 (measured while every pass's mask was held: see _computed_from).
QUERY_BLOCK = 64


def _grouped_scores(q, k, q_len, kv_len, causal, first_row=0):
    """Scaled scores [b, kv, group, tq, s] in fp32 and their visibility (same shape, broadcast), for the queries
    at rows first_row, first_row + 1, ... of their chunk."""
    b, tq, n, h = q.shape
    kv = k.shape[2]
    q = q.reshape(b, tq, kv, n // kv, h)
    scores = jnp.einsum("bqkgh,bskh->bkgqs", q, k, preferred_element_type=jnp.float32) * h**-0.5
    rows, cols = first_row + jnp.arange(tq)[:, None], jnp.arange(k.shape[1])[None, :]
    visible = (rows < q_len[:, None, None]) & (cols < kv_len[:, None, None])
    if causal:
        visible &= cols <= rows
    return scores, visible[:, None, None]


def _block_rows(tq: int) -> int:
    """The queries of each pass: QUERY_BLOCK, or all tq where it does not divide them."""
    return QUERY_BLOCK if tq % QUERY_BLOCK == 0 else tq


def _query_blocks(x):
    """[b, tq, ...] -> [blocks, b, rows, ...], rows = _block_rows(tq)."""
    b, tq = x.shape[:2]
    rows = _block_rows(tq)
    return jnp.moveaxis(x.reshape(b, tq // rows, rows, *x.shape[2:]), 1, 0)


def _from_query_blocks(x):
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def _computed_from(x, value):
    """`value` (a scalar) plus a zero computed from x's first element: equal to value, but no longer a constant.

    Under the layer scan, jax's partial evaluation for the backward pass computes whatever depends on
    constants alone once, before the loop, and keeps it through the whole stack. A pass's mask depends on
    its first row and the lengths alone, so every pass's mask, broadcast to [b, kv, group, rows, keys], was
    made before the layers and held: llama3_405b at 128K on the XLA:CPU proxy, 128 GiB per device of masks
    (200.54 GiB in all; 84.35 with the first row computed from the queries)."""
    zero = jax.lax.bitcast_convert_type(x.reshape(-1)[0].astype(jnp.float32), jnp.int32) & 0
    return value + zero.astype(jnp.result_type(value))


def _xla_forward(q, k, v, q_len, kv_len, causal):
    b, tq, n, h = q.shape
    rows = _block_rows(tq)

    def block(index_and_q):
        index, q = index_and_q
        scores, visible = _grouped_scores(q, k, q_len, kv_len, causal, _computed_from(q, index * rows))
        lse = jax.nn.logsumexp(jnp.where(visible, scores, -jnp.inf), axis=-1)
        safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        p = jnp.where(visible, jnp.exp(scores - safe_lse[..., None]), 0.0)
        out = jnp.einsum("bkgqs,bskh->bqkgh", p, v.astype(jnp.float32))
        return out.reshape(q.shape).astype(q.dtype), jnp.moveaxis(lse.reshape(b, n, -1), 2, 1)  # lse [b, rows, n]

    blocks = _query_blocks(q)
    out, lse = jax.lax.map(block, (jnp.arange(blocks.shape[0]), blocks))
    return _from_query_blocks(out), jnp.moveaxis(_from_query_blocks(lse), 1, 2)


def _xla_backward(q, k, v, q_len, kv_len, causal, out, lse, d_out):
    b, tq, n, h = q.shape
    kv = k.shape[2]
    rows = _block_rows(tq)

    def block(d_kv, inputs):
        index, q, out, lse, d_out = inputs
        grouped = lambda x: x.reshape(b, rows, kv, n // kv, h).astype(jnp.float32)  # noqa: E731
        scores, visible = _grouped_scores(q, k, q_len, kv_len, causal, index * rows)
        lse = jnp.moveaxis(lse, 1, 2).reshape(b, kv, n // kv, rows)
        p = jnp.where(visible, jnp.exp(scores - lse[..., None]), 0.0)
        d_out, out = grouped(d_out), grouped(out)
        dv = jnp.einsum("bkgqs,bqkgh->bskh", p, d_out)
        dp = jnp.einsum("bqkgh,bskh->bkgqs", d_out, v.astype(jnp.float32))
        delta = jnp.einsum("bqkgh,bqkgh->bkgq", d_out, out)
        ds = p * (dp - delta[..., None]) * h**-0.5
        dq = jnp.einsum("bkgqs,bskh->bqkgh", ds, k.astype(jnp.float32)).reshape(q.shape)
        dk = jnp.einsum("bkgqs,bqkgh->bskh", ds, grouped(q))
        return (d_kv[0] + dk, d_kv[1] + dv), dq.astype(q.dtype)

    blocks = [_query_blocks(x) for x in (q, out, jnp.moveaxis(lse, 2, 1), d_out)]
    zeros = jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32)  # varying as k and v in a shard_map
    (dk, dv), dq = jax.lax.scan(block, zeros, (jnp.arange(blocks[0].shape[0]), *blocks))
    return _from_query_blocks(dq), dk.astype(k.dtype), dv.astype(v.dtype)


XLA_KERNEL = PaddedKernel(_xla_forward, _xla_backward)


# ---------------------------------------------------------------------------------------------
# Partial attentions combined by their log-sum-exp


def _rows_covered(q_len, kv_len, tq):
    """[b, tq]: rows the part covers (within q_len, and the row's part has keys at all)."""
    return (jnp.arange(tq)[None, :] < q_len[:, None]) & (kv_len[:, None] > 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def combined_attention(kernel: PaddedKernel, causal: tuple[bool, ...], q, keys, values, q_lens, kv_lens):
    """Attention of q [b, t, n, h] over the union of several key sets (keys/values: tuples of
    [b, s_i, kv, h]; part i covers rows < q_lens[i] and keys < kv_lens[i], none where kv_lens[i] is 0).
    Rows no part covers are 0."""
    return _combined_forward(kernel, causal, q, keys, values, q_lens, kv_lens)[0]


def _combined_forward(kernel, causal, q, keys, values, q_lens, kv_lens):
    t = q.shape[1]
    outs, lses = [], []
    for k, v, q_len, kv_len, is_causal in zip(keys, values, q_lens, kv_lens, causal):
        with _prefix_scope(is_causal):
            out, lse = kernel.forward(q, k, v, q_len, jnp.maximum(kv_len, 1), is_causal)
        covered = _rows_covered(q_len, kv_len, t)
        outs.append(jnp.where(covered[:, :, None, None], out.astype(jnp.float32), 0.0))
        lses.append(jnp.where(covered[:, None, :], lse, -jnp.inf))
    lse = functools.reduce(jnp.logaddexp, lses)  # [b, n, t]
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    weight = lambda part_lse: jnp.exp(part_lse - lse).transpose(0, 2, 1)[..., None]  # noqa: E731 - [b, t, n, 1]
    out = sum(o * weight(part_lse) for o, part_lse in zip(outs, lses)).astype(q.dtype)
    # Tagged like the other flash kernels' residuals (attention.py): a remat policy that keeps the
    # attention keeps these and never re-runs the forward pass.
    residuals = jax.tree.map(
        lambda r: checkpoint_name(r, "attention_context"), (q, keys, values, q_lens, kv_lens, out, lse)
    )
    return out, residuals


def _combined_backward(kernel, causal, residuals, d_out):
    q, keys, values, q_lens, kv_lens, out, lse = residuals
    t = q.shape[1]
    dq = jnp.zeros(q.shape, jnp.float32)
    d_keys, d_values = [], []
    for k, v, q_len, kv_len, is_causal in zip(keys, values, q_lens, kv_lens, causal):
        covered = _rows_covered(q_len, kv_len, t)[:, :, None, None]
        with _prefix_scope(is_causal):
            part_dq, dk, dv = kernel.backward(
                q,
                k,
                v,
                q_len,
                jnp.maximum(kv_len, 1),
                is_causal,
                out,
                lse,
                jnp.where(covered, d_out, 0).astype(d_out.dtype),
            )
        # What a kernel leaves in rows and keys outside its lengths is unspecified: zero it.
        dq += jnp.where(covered, part_dq.astype(jnp.float32), 0.0)
        keys_used = (jnp.arange(k.shape[1])[None, :] < kv_len[:, None])[:, :, None, None]
        d_keys.append(jnp.where(keys_used, dk, 0).astype(k.dtype))
        d_values.append(jnp.where(keys_used, dv, 0).astype(v.dtype))
    return dq.astype(q.dtype), tuple(d_keys), tuple(d_values), None, None


combined_attention.defvjp(_combined_forward, _combined_backward)


def _prefix_scope(causal: bool):
    """The scope of a part's kernel call: PREFIX_SCOPE for the prefix (the part that is not causal)."""
    return contextlib.nullcontext() if causal else jax.named_scope(PREFIX_SCOPE)


# ---------------------------------------------------------------------------------------------
# One chunk, and the whole of this device's slice


def chunk_attention(
    q, k, v, segments, all_keys, all_values, all_segments, start, in_chunk: Callable, kernel: PaddedKernel
) -> jax.Array:
    """Causal document attention of one chunk of queries q [b, C, n, h] that begins at token `start`
    (traced) of the sequence. k/v [b, C, kv, h] and segments [b, C] are the chunk's own; all_* are the
    whole sequence's in token order. in_chunk(q, k, v, segments) is exact causal document attention
    of a chunk on its own keys (cuDNN's packed layout, the blocked kernel, ...)."""
    chunk, seq = segments.shape[1], all_segments.shape[1]
    # The chunk's first document: where it starts in the sequence, and how many of the chunk's rows it fills.
    run_start = jax.lax.cummax(jnp.where(_document_starts(all_segments), jnp.arange(seq), 0), axis=1)
    document_start = jax.lax.dynamic_index_in_dim(run_start, start, axis=1, keepdims=False)  # [b]
    prefix = start - document_start  # keys of that document in earlier chunks (0: it starts here)
    later_starts = _document_starts(segments).at[:, 0].set(False)
    rows = jnp.where(later_starts.any(axis=1), jnp.argmax(later_starts, axis=1), chunk).astype(jnp.int32)

    def first_document():  # rows [0, rows): causal on their own rows, plus the whole prefix
        roll = jax.vmap(lambda x, shift: jnp.roll(x, -shift, axis=0))
        keys = (k, roll(all_keys, document_start))
        values = (v, roll(all_values, document_start))
        return combined_attention(kernel, (True, False), q, keys, values, (rows, rows), (rows, prefix))

    def own_chunk():
        return in_chunk(q, k, v, segments)

    def both():
        first_rows = (jnp.arange(chunk)[None, :] < rows[:, None])[:, :, None, None]
        return jnp.where(first_rows, first_document(), own_chunk())

    # Skip what no row needs: no document crosses into the chunk (the chunk alone is exact), or one
    # document fills every row (the two partial attentions are exact) — long documents, unpacked rows.
    branch = jnp.where(jnp.all(prefix == 0), 0, jnp.where(jnp.all(rows == chunk), 1, 2))
    with jax.named_scope(CHUNK_CHOICE_SCOPE):
        return jax.lax.switch(branch, [own_chunk, first_document, both])


def sequence_sharded_attention(
    q, k, v, segments, shards: int, balanced: bool, in_chunk: Callable, kernel: PaddedKernel
) -> jax.Array:
    """Inside a shard_map over SEQUENCE_AXIS: this device's queries q [b, t, n, h] (t = T / shards),
    keys/values [b, t, kv, h] and segment ids [b, t] -> its attention output [b, t, n, h]."""
    order = chunk_order(shards, balanced)
    gather = lambda x: _to_token_order(jax.lax.all_gather(x, SEQUENCE_AXIS, axis=1, tiled=True), order)  # noqa: E731
    return device_attention(
        q,
        k,
        v,
        segments,
        gather(k),
        gather(v),
        gather(segments),
        jax.lax.axis_index(SEQUENCE_AXIS),
        shards,
        balanced,
        in_chunk,
        kernel,
    )


def device_attention(
    q,
    k,
    v,
    segments,
    all_keys,
    all_values,
    all_segments,
    device,
    shards: int,
    balanced: bool,
    in_chunk: Callable,
    kernel: PaddedKernel,
) -> jax.Array:
    """Device `device`'s share, given its own slice (q, k, v, segments) and the whole sequence's keys,
    values and segment ids in token order. (One GPU can run every device's share in turn: a check of the
    whole path without a mesh.)"""
    local_chunks = len(chunk_order(shards, balanced)) // shards
    size = q.shape[1] // local_chunks
    outs = []
    for i in range(local_chunks):
        chunk = device if i == 0 else 2 * shards - 1 - device  # chunk_order's pairing
        own = slice(i * size, (i + 1) * size)
        outs.append(
            chunk_attention(
                q[:, own],
                k[:, own],
                v[:, own],
                segments[:, own],
                all_keys,
                all_values,
                all_segments,
                chunk * size,
                in_chunk,
                kernel,
            )
        )
    return jnp.concatenate(outs, axis=1)
