"""What every way of running the layer stack shares: one layer's inputs, the stack's description, apply_block.

LayerInputs   what each layer reads besides the residual stream (rotary angles, documents, positions),
              one typed pytree, the same for every layer: a scan closes over it, a pipeline makes one per
              micro-batch. Adding an input to Block is a field here (made in llama.layer_inputs).
Stack         how the layers run, chosen from the config: how to make one Block, the function making its
              inputs, the trace's context, the remat policy (and its every_n_layers) and the pipeline layout;
              `way` names the way, inside_stage() is the stack as a pipeline stage's body runs it.
apply_block   one layer on its own params (one slice of the stacked ones), what every way calls per layer.
Head          the loss after the layers, for the way that computes it inside the stack (1F1B).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
from flax import nnx

from llama_jax.model.context import TraceContext
from llama_jax.model.dropout import DropoutKey
from llama_jax.model.params import abstract
from llama_jax.model.pipeline import PipelineLayout


class LayerInputs(NamedTuple):
    """What every layer reads besides the residual stream x: the same for all layers."""

    cos: jax.Array  # [batch, seq, 1, head_dim / 2] rotary angles of the positions, fp32
    sin: jax.Array
    segment_ids: jax.Array | None  # [batch, seq] each token's document (>= 1); None: the row is one document
    positions: jax.Array  # [batch, seq] each token's position in its document


@dataclass(frozen=True)
class Stack:
    """How the layer stack runs (Llama.stack makes it from the config); run.run_stack runs it."""

    block: Callable[[TraceContext, nnx.Rngs], nnx.Module]  # (context, rngs) -> one layer (llama.Block)
    inputs: Callable[[jax.Array | None, jax.Array], LayerInputs]  # (segment_ids, positions) -> the layers' inputs
    names: tuple[str, ...]  # the logical axis names of the activations between layers
    context: TraceContext  # what the trace is for (the block's too): platform, mesh, logical-axis rules
    policy: Callable | None = None  # remat: what a layer keeps for its backward pass (None: everything)
    every_n: int = 1  # under a policy, only layers 0, n, 2n, ... recompute (remat.every_n_layers)
    pipeline: PipelineLayout | None = None  # stages over the mesh's pipeline axis (mesh.pipeline > 1)

    @property
    def way(self) -> str:
        """scan | grouped | gpipe | 1f1b: the module of this package that runs the layers."""
        if self.pipeline is not None:
            return self.pipeline.schedule
        return "grouped" if self.policy is not None and self.every_n > 1 else "scan"

    @property
    def computes_loss(self) -> bool:
        """Whether, given a Head, the stack returns the loss rather than the activations (1F1B: a micro-batch's
        loss runs on the last stage as soon as its forward pass ends, so that its backward pass can start)."""
        return self.way == "1f1b"

    @functools.cached_property
    def graph(self) -> nnx.GraphDef:
        """One layer's graph, traced in this stack's context: what apply_block merges with one layer's params."""
        return nnx.graphdef(abstract(lambda: self.block(self.context, nnx.Rngs(0))))

    def inside_stage(self) -> Stack:
        """This stack as a pipeline stage's shard_map body runs it: its block (graph) and its own constraints, in the
        stage's context (the stage axis manual, out of the rules)."""
        return dataclasses.replace(self, context=self.context.inside_stage())

    def constrain(self, a: jax.Array) -> jax.Array:
        """Activations between layers [..., batch, seq, embed] (any leading axes: micro-batches, buffers) sharded
        as `names` say, by the context's rules."""
        return self.context.constrain(a, (None,) * (a.ndim - len(self.names)) + self.names)


class Head(NamedTuple):
    """The loss of the final activations, computed inside the stack where the stack computes the loss."""

    loss: Callable  # (params, x [batch, seq, embed], targets, loss_mask, context) -> the summed loss, fp32
    params: Any  # its params (differentiated like the layers')
    targets: jax.Array  # [batch, seq]
    loss_mask: jax.Array  # [batch, seq]


def apply_block(
    stack: Stack, params, x: jax.Array, inputs: LayerInputs, dropout: DropoutKey | None = None, cache=None
) -> tuple[jax.Array, Any]:
    """One layer: x [batch, seq, embed] -> ([batch, seq, embed], its cache), with one layer's params (a slice of
    the stack's [layers, ...] leaves). A dropout key turns LoRA's dropout on (training a peft run); a cache (the
    layer's keys and values of earlier tokens) makes it decode."""
    return nnx.merge(stack.graph, params)(x, inputs, dropout, cache)
