"""The embedding lookup: each token's row of the table [vocab, embed].

Where the table arrives split over its vocabulary alone (tensor parallelism, with context.read having gathered
the embed axis under context parallelism), each device looks up the tokens whose rows it holds and the partial
rows are summed over the vocabulary's mesh axes: Megatron's vocab-parallel embedding. The table is never whole
on a device, and its gradient is a scatter into the device's own rows. Left to XLA's partitioner, a lookup in a
table split along the looked-up axis all-gathers the table: llama3_405b's 128K stage held the whole [128256,
16384] table, and its whole gradient, on every device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from llama_jax.model.context import TraceContext, rule_axes


def lookup(table: jax.Array, tokens: jax.Array, context: TraceContext) -> jax.Array:
    """table [vocab, embed] as context.read returns it, tokens [batch, seq] in [0, vocab) -> [batch, seq, embed]."""
    vocab, embed = context.read_axes(("vocab", "embed"))
    batch, seq = context.mesh_axes(("batch", "seq"))
    token_axes = set(rule_axes(batch)) | set(rule_axes(seq))
    if context.axis_size(vocab) == 1 or embed is not None or token_axes & set(rule_axes(vocab)):
        return jnp.take(table, tokens, axis=0)
    axes = rule_axes(vocab)
    # Sequence parallelism splits the residual stream's sequence over the vocabulary's axes as well: the partial
    # rows are then reduce-scattered along the sequence, each device keeping its own tokens' rows.
    residual_seq = context.mesh_axes(("residual_seq",))[0]
    scatter = rule_axes(residual_seq) == (*rule_axes(seq), *axes)

    def own_rows(table, tokens):
        rows = tokens - jax.lax.axis_index(axes) * table.shape[0]
        held = (rows >= 0) & (rows < table.shape[0])
        found = jnp.where(held[..., None], jnp.take(table, jnp.where(held, rows, 0), axis=0), 0)
        if scatter:
            return jax.lax.psum_scatter(found, axes, scatter_dimension=1, tiled=True)
        return jax.lax.psum(found, axes)

    return jax.shard_map(
        own_rows,
        mesh=context.shard_map_mesh,
        in_specs=(PartitionSpec(vocab, None), PartitionSpec(batch, seq)),
        out_specs=PartitionSpec(batch, residual_seq if scatter else seq, None),
    )(table, tokens)
