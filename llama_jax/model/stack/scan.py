"""The plain way, and the layers' params of every way: Block under nn.scan.

One compiled layer body runs n_layers times, so compile time does not grow with depth, and every layer weight
(and the decode cache) gets a leading `layers` axis, named `layers` for the logical-axis table. Every way stores
the layers so: `init` runs this way whatever the config says, and the other ways run the params it made.
Under a remat policy that recomputes every layer the body is Block under nn.remat.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from llama_jax.model.stack.layer import LayerInputs, Stack


def scanned(block: type[nn.Module], n_layers: int, stack: Stack) -> type[nn.Module]:
    """`block` (Block) as a module of n_layers layers: (x, LayerInputs) -> (x, None), params [n_layers, ...]."""
    if stack.policy is not None and stack.every_n == 1:
        # prevent_cse=False is safe (and faster) because scan already stops XLA from merging
        # the recomputation back into the forward pass.
        block = nn.remat(block, policy=stack.policy, prevent_cse=False)
    return nn.scan(
        block,
        variable_axes={"params": 0, "cache": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast,),
        length=n_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )


def run_scan(layers: nn.Module, x: jax.Array, inputs: LayerInputs) -> jax.Array:
    """x [batch, seq, embed] through the scanned layers (a bound `scanned` module): Flax applies each Block,
    splitting the dropout key per layer and keeping the decode cache."""
    return layers(x, inputs)[0]
