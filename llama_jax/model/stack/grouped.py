"""Grouped remat (remat.every_n_layers > 1), and a pipeline stage's group of layers: the layers applied in
order from their params, one apply_block each, in a jax.lax.scan over their [layers, ...] leaves.

Under a remat policy each layer recomputes in the backward pass, or with every_n > 1 only layers 0, n, 2n, ...:
the weights are viewed as [n / every_n, every_n, ...] groups whose first layer runs under the policy and whose
others keep all their activations (when memory is nearly enough). LoRA's dropout (training only) gets a key per
layer. A pipeline stage with fewer layers than slots (uneven stages) runs its first `layers` only: each slot is a
conditional, named LAYER_SLOT_SCOPE in the compiled program (plan.py counts how often it runs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llama_jax.model.dropout import DropoutKey, layer_keys
from llama_jax.model.stack.layer import LayerInputs, Stack, apply_block

LAYER_SLOT_SCOPE = "pipeline_layer_slot"  # the name of the conditional that skips an empty slot (uneven stages)


def run_layers(
    stack: Stack,
    params,
    x: jax.Array,
    inputs: LayerInputs,
    dropout_key: jax.Array | None = None,
    layers: jax.Array | None = None,
) -> jax.Array:
    """x [batch, seq, embed] through the layers whose params (leaves [n, ...]) are given, in order, recomputing as
    stack.policy and stack.every_n say. With `layers` (a pipeline stage with fewer layers than slots) only the
    first `layers` of the n run; the others are skipped. A dropout key gives each layer its own (dropout.py)."""

    def layer(params, key, x):
        return apply_block(stack, params, x, inputs, None if key is None else DropoutKey.of_layer(key, False))[0]

    n_layers = jax.tree.leaves(params)[0].shape[0]
    keys = None if dropout_key is None else layer_keys(dropout_key, n_layers, scanned=False)

    def scan(step, x, weights, width: int = 1):
        """step(w, x) over the leading axis of weights, each entry `width` layers; those past `layers` skipped."""
        if layers is None:
            return jax.lax.scan(lambda x, w: (step(w, x), None), x, weights)[0]

        def maybe(x, w_and_index):
            w, index = w_and_index
            with jax.named_scope(LAYER_SLOT_SCOPE):
                return jax.lax.cond(index * width < layers, lambda x: step(w, x), lambda x: x, x), None

        return jax.lax.scan(maybe, x, (weights, jnp.arange(jax.tree.leaves(weights)[0].shape[0])))[0]

    policy, every_n = stack.policy, stack.every_n
    if policy is None:
        return scan(lambda p, x: layer(*p, x), x, (params, keys))
    recomputed_layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
    if every_n == 1:
        return scan(lambda p, x: recomputed_layer(*p, x), x, (params, keys))
    groups = jax.tree.map(lambda w: w.reshape(n_layers // every_n, every_n, *w.shape[1:]), (params, keys))

    def group(params_and_keys, x):
        first, rest = jax.tree.map(lambda w: w[0], params_and_keys), jax.tree.map(lambda w: w[1:], params_and_keys)
        x = recomputed_layer(*first, x)
        return jax.lax.scan(lambda x, p: (layer(*p, x), None), x, rest)[0]

    return scan(group, x, groups, every_n)


def run_stage(
    stack: Stack, weights, layers: jax.Array | None, x: jax.Array, segment_ids: jax.Array, positions: jax.Array
) -> jax.Array:
    """A pipeline stage's group of layers (weights [slots, ...]) on one micro-batch: x [rows, T, D], segment_ids,
    positions [rows, T]; `layers`: how many of the slots hold layers, or None for all."""
    return run_layers(stack, weights, x, stack.inputs(segment_ids, positions), layers=layers)
