"""The plain way: one compiled layer body under jax.lax.scan over the layers' stacked params.

One compiled body runs n_layers times, so compile time does not grow with depth; every layer weight (and the
decode cache) has a leading `layers` axis, named `layers` for the logical-axis table, in every way. Under a
remat policy that recomputes every layer, the body is the layer under jax.checkpoint. Decoding runs this way,
each layer reading and extending its slice of the cache.
"""

from __future__ import annotations

import jax

from llama_jax.model.dropout import DropoutKey, layer_keys
from llama_jax.model.stack.layer import LayerInputs, Stack, apply_block


def run_scan(stack: Stack, params, x: jax.Array, inputs: LayerInputs, dropout_key: jax.Array | None = None, cache=None):
    """x [batch, seq, embed] through the layers whose params (leaves [n_layers, ...]) are given -> x, or with a
    cache ([n_layers, ...] leaves) (x, the updated cache). A dropout key gives each layer its own (dropout.py)."""
    n_layers = jax.tree.leaves(params)[0].shape[0]
    keys = None if dropout_key is None else layer_keys(dropout_key, n_layers, scanned=True)

    def layer(x, params_key_and_cache):
        params, key, cache = params_key_and_cache
        dropout = None if key is None else DropoutKey.of_layer(key, scanned=True)
        return apply_block(stack, params, x, inputs, dropout, cache)

    if stack.policy is not None:
        # prevent_cse=False is safe (and faster) because scan already stops XLA from merging
        # the recomputation back into the forward pass.
        layer = jax.checkpoint(layer, policy=stack.policy, prevent_cse=False)
    x, cache = jax.lax.scan(layer, x, (params, keys, cache))
    return x if cache is None else (x, cache)
