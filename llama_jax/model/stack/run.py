"""run_stack: the one entry to the layer stack, whichever way the config chose (Stack.way)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from llama_jax.model.stack import gpipe, grouped, one_f_one_b, scan
from llama_jax.model.stack.layer import Head, Stack


def run_stack(
    stack: Stack,
    layers: nn.Module,
    x: jax.Array,
    segment_ids: jax.Array | None,
    positions: jax.Array,
    head: Head | None = None,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """x [batch, seq, embed] (the embeddings) through every layer -> [batch, seq, embed]; or, given a head where
    the stack computes the loss (Stack.computes_loss: 1F1B), the summed loss.

    layers: the model's child that holds the layers' params, Block under nn.scan (scan.scanned). While the model
    initialises it runs, whatever the way, and so creates the params every way reads; the scan way always runs
    it; the other ways take its params and apply each layer with apply_block. segment_ids and positions [batch,
    seq] make the layers' inputs (stack.inputs). dropout_key: LoRA's dropout in the ways that apply the layers
    themselves (nn.scan splits the model's own key).
    """
    if layers.is_initializing() or stack.way == "scan":
        x = scan.run_scan(layers, x, stack.inputs(segment_ids, positions))
        return (
            x
            if head is None or not stack.computes_loss
            else head.loss(head.params, x, head.targets, head.loss_mask, stack.context)
        )
    params = layers.variables["params"]
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
