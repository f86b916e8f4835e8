"""run_stack: the one entry to the layer stack, whichever way the config chose (Stack.way)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llama_jax.model.stack import gpipe, grouped, one_f_one_b, scan
from llama_jax.model.stack.layer import Head, Stack


def run_stack(
    stack: Stack,
    params,
    x: jax.Array,
    segment_ids: jax.Array | None,
    positions: jax.Array,
    head: Head | None = None,
    dropout_key: jax.Array | None = None,
    cache=None,
):
    """x [batch, seq, embed] (the embeddings) through every layer -> [batch, seq, embed]; or, given a head where
    the stack computes the loss (Stack.computes_loss: 1F1B), the summed loss; or, given a cache (decoding, which
    runs the plain way), (x, the cache with these tokens' keys and values).

    params: the layers' params, each leaf [n_layers, ...] (as llama.Llama stacks them; a pipeline's in its
    storage order, stages.py). segment_ids and positions [batch, seq] make the layers' inputs (stack.inputs).
    dropout_key: LoRA's dropout, split over the layers by the way that runs them (dropout.py).
    """
    if cache is not None or stack.way == "scan":
        return scan.run_scan(stack, params, x, stack.inputs(segment_ids, positions), dropout_key, cache)
    if stack.way == "grouped":
        return grouped.run_layers(stack, params, x, stack.inputs(segment_ids, positions), dropout_key)
    # A pipeline splits the batch into micro-batches: every row's documents spelled out. (Adapters are not
    # pipelined: config validation keeps peft and pipelines apart.)
    if segment_ids is None:
        segment_ids = jnp.ones(x.shape[:2], jnp.int32)
    if stack.way == "1f1b" and head is not None:
        batch = dict(targets=head.targets, loss_mask=head.loss_mask, segment_ids=segment_ids, positions=positions)
        return one_f_one_b.pipelined_loss(stack, head.loss)(params, head.params, x, batch)
    return gpipe.run_gpipe(stack, params, x, segment_ids, positions)
