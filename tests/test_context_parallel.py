"""Context parallelism (context_parallel.py): every chunk of queries sees its causal block and its first
document's prefix, nothing else, whatever the layout of the chunks over the devices."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from llama_jax.distributed import sharding
from llama_jax.model import context_parallel, cudnn
from llama_jax.model.attention import attention, document_mask
from llama_jax.model.context import TraceContext
from llama_jax.model.context_parallel import XLA_KERNEL, chunk_order, combined_attention

TOLERANCE = 1e-5  # fp32 against XLA's attention over the whole sequence, relative to the largest magnitude


def packed_rows(seq: int, chunk: int) -> np.ndarray:
    """Rows covering the three ways a chunk can start: a document crossing into it from earlier chunks
    (row 0: uneven documents, one spanning several chunks), one document filling the whole row (row 1), and
    documents that begin exactly at chunk boundaries, ending in padding (row 2)."""
    ids = np.zeros((3, seq), np.int32)
    cuts = [0, 5, chunk + 3, 3 * chunk + 7, seq - chunk // 2, seq]
    for doc, (start, end) in enumerate(zip(cuts, cuts[1:]), start=1):
        ids[0, start:end] = doc
    ids[1] = 1
    for doc, start in enumerate(range(0, seq - chunk, chunk), start=1):
        ids[2, start : start + chunk] = doc
    return ids


def inputs(seq: int, batch: int = 3, heads: int = 4, kv_heads: int = 2, head_dim: int = 16):
    rng = np.random.default_rng(seq)
    q = jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, seq, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((batch, seq, kv_heads, head_dim)), jnp.float32)
    return q, k, v, jnp.asarray(rng.standard_normal(q.shape), jnp.float32)


def reference(q, k, v, segments):
    return jax.nn.dot_product_attention(
        q, k, v, mask=document_mask(segments, segments), is_causal=True, implementation="xla"
    )


def output_and_gradients(fn, q, k, v, segments, weights):
    def run(q, k, v):
        out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, segments), q, k, v)
        return out, pullback(weights)

    return jax.jit(run)(q, k, v)


def assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w))) < TOLERANCE


def sequence_mesh(shards: int):
    return jax.make_mesh((shards,), ("sequence",), axis_types=(AxisType.Auto,), devices=jax.devices()[:shards])


RULES = (("batch", None), ("seq", "sequence"), ("act_heads", None), ("act_kv_heads", None), ("head_dim", None))


def on_mesh(shards: int, balanced: bool, implementation: str, q, k, v, segments, weights):
    """attention() as the model calls it, with the sequence split over `shards` devices and laid out as
    put_batch lays it out: output and gradients, in sequence order."""
    order = chunk_order(shards, balanced)

    def layout(x, chunks):
        parts = jnp.split(x, len(chunks), axis=1)
        return jnp.concatenate([parts[c] for c in chunks], axis=1)

    mesh = sequence_mesh(shards)
    context = TraceContext.on_mesh(mesh, RULES)  # the model's, on this mesh

    def run(q, k, v, segments):
        out = attention(
            *(layout(x, order) for x in (q, k, v, segments)), implementation, balanced=balanced, context=context
        )
        return layout(out, [order.index(c) for c in range(len(order))])

    with sharding.activate(mesh):
        return output_and_gradients(run, q, k, v, segments, weights)


@pytest.mark.parametrize("shards, balanced, query_block", [(4, True, 256), (2, False, 256), (4, True, 8)])
def test_context_parallel_matches_the_whole_sequence_on_packed_documents(shards, balanced, query_block, monkeypatch):
    """query_block 8: the XLA kernel takes each chunk's 16 or 32 queries in passes of 8 (QUERY_BLOCK)."""
    monkeypatch.setattr(context_parallel, "QUERY_BLOCK", query_block)
    seq = 128
    q, k, v, weights = inputs(seq)
    chunk = seq // len(chunk_order(shards, balanced))
    segments = jnp.asarray(packed_rows(seq, chunk))
    want = output_and_gradients(reference, q, k, v, segments, weights)
    got = on_mesh(shards, balanced, "xla", q, k, v, segments, weights)
    assert_close(got, want)


def test_one_document_per_row_and_the_blocked_kernel_on_each_chunk():
    """Chunks of 256 tokens: each chunk's own block runs the blocked kernel; one document fills every row,
    so every chunk but the first takes the path without the in-chunk kernel."""
    seq = 1024
    q, k, v, weights = inputs(seq, batch=1)
    segments = jnp.ones((1, seq), jnp.int32)
    want = output_and_gradients(reference, q, k, v, segments, weights)
    assert_close(on_mesh(2, True, "blocked", q, k, v, segments, weights), want)


def test_partial_attentions_combine_into_attention_over_their_union():
    """Two key sets (a causal block and an unmasked prefix) with per-row lengths, one absent for a row."""
    q, k, v, weights = inputs(16, batch=2)
    prefix_k, prefix_v = inputs(24, batch=2)[1:3]
    rows, prefix = jnp.array([10, 16]), jnp.array([0, 24])

    def combined(q, k, v, _):
        return combined_attention(
            XLA_KERNEL, (True, False), q, (k, prefix_k), (v, prefix_v), (rows, rows), (rows, prefix)
        )

    def union(q, k, v, _):
        keys, values = jnp.concatenate([prefix_k, k], axis=1), jnp.concatenate([prefix_v, v], axis=1)
        rows_ = jnp.arange(16)[None, :, None]
        cols = jnp.arange(40)[None, None, :]
        own = (cols >= 24) & (cols - 24 <= rows_) & (cols - 24 < rows[:, None, None])
        visible = (own | (cols < prefix[:, None, None])) & (rows_ < rows[:, None, None])
        out = jax.nn.dot_product_attention(q, keys, values, mask=visible[:, None], implementation="xla")
        return jnp.where((rows_ < rows[:, None, None])[..., None], out, 0.0)

    assert_close(
        output_and_gradients(combined, q, k, v, None, weights), output_and_gradients(union, q, k, v, None, weights)
    )


def test_the_cudnn_kernel_runs_on_the_installed_jax():
    """cuDNN's padded calls use jax's private backward; if a jax release changed it, context parallelism
    would fall back to the XLA kernel on GPUs. This test notices that first."""
    assert cudnn.PADDED_KERNEL is not XLA_KERNEL


def test_the_balanced_layout_is_the_one_put_batch_makes():
    tokens = np.arange(16)[None, :]
    chunks = np.split(tokens, 8, axis=1)
    assert (sharding.balance_sequence(tokens, 4) == np.concatenate([chunks[c] for c in chunk_order(4, True)], 1)).all()
    assert chunk_order(4, True) == [0, 7, 1, 6, 2, 5, 3, 4] and chunk_order(4, False) == [0, 1, 2, 3]


def test_a_layer_scan_does_not_hoist_every_passs_mask(monkeypatch):
    """Under a scan over layers, jax's partial evaluation for the backward pass computes whatever depends on
    constants alone before the loop. A pass's mask must not be such a value: [passes, b, kv, group, rows, keys]
    of masks, made before the layers and held, was most of llama3_405b's 128K step on the XLA:CPU proxy."""
    monkeypatch.setattr(context_parallel, "QUERY_BLOCK", 8)
    q, k, v, _ = inputs(32, batch=2)
    lengths = jnp.array([32, 20])

    def loss(q, k, v):
        def layer(x, _):
            return combined_attention(XLA_KERNEL, (False,), x, (k,), (v,), (lengths,), (lengths,)), None

        return jax.lax.scan(layer, q, None, length=2)[0].sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    passes = 32 // 8
    stacked_masks = [
        var.aval
        for var in _all_outvars(jaxpr.jaxpr)
        if var.aval.dtype == jnp.bool_ and var.aval.ndim == 6 and var.aval.shape[0] == passes
    ]
    assert not stacked_masks


def _all_outvars(jaxpr):
    for eqn in jaxpr.eqns:
        yield from eqn.outvars
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _all_outvars(sub)
