"""Pipeline parallelism: the layer stack cut into stages over the mesh's `pipeline` axis.

With mesh.pipeline = P stages and mesh.pipeline_repeats = R, the L layers form P·R groups of K = L/(P·R)
consecutive layers, and group g runs on stage g mod P: each device holds R groups that are P groups apart
(the circular, or interleaved, schedule; R = 1 is plain GPipe). A pass through the pipeline carries M
micro-batches (mesh.pipeline_microbatches, or all of train.microbatches; the step accumulates the gradient
over the passes), which flow through the stages inside the one jitted step:

    iteration t:  stage p runs micro-batch (t - p) mod M through its group of repeat (t - p) // M,
                  then every stage hands its output to the next (a collective permute); the last
                  stage's output wraps around to stage 0, which keeps it for the micro-batch's next
                  repeat (or, after the last repeat, as its final output).

Stage 0 takes micro-batch t's embeddings for t < M; they are looked up before the loop with the batch split
over all the devices, as without pipelining, and gathered over the stages (XLA's partitioner cannot split
the lookup's gather inside a stage, where the pipeline axis is manual, in every layout). The loop runs
M·R + P - 1 iterations, of which each stage works M·R: the bubble is (P - 1) / (M·R + P - 1) of the pass.
Gradients flow back through the same loop by autodiff (GPipe: every stage keeps its inputs of all M
micro-batches for the backward pass, fewer of them with recomputation), so clipping and the
non-finite-step guard see the whole batch's gradient as before.

After the loop stage 0 holds every micro-batch's final activations; a reduce-scatter hands each stage
M/P of them, so the output projection and the loss are computed once, spread over the stages: the
embedding and the output projection live on every stage (sharded over fsdp and tensor like the rest,
replicated over pipeline), used by stage 0 and by all stages' share of the loss respectively.

Inside a stage the pipeline axis is manual (a shard_map over it alone); the other axes stay automatic,
so fsdp, tensor (and sequence parallelism) and sequence work within each stage as without pipelining.

Parameters of the layers keep their [L, ...] shape, but in *storage order*: device p's contiguous block
holds its R groups (p, P + p, 2P + p, ...). With R = 1 that is the natural order. Checkpoints record the
layout in their config, and restoring into another one reorders the layers (to_storage_order /
to_natural_order), so a run saved with one pipeline layout resumes with any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from llama_jax.model import platform

STAGE_AXIS = "pipeline"


@dataclass(frozen=True)
class PipelineLayout:
    stages: int  # P: devices along the pipeline axis
    repeats: int  # R: groups of layers per device
    microbatches: int  # M: micro-batches per step (a multiple of P)

    @property
    def iterations(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of the step a stage waits: (P - 1) / (M·R + P - 1)."""
    return (stages - 1) / (microbatches * repeats + stages - 1)


# ---------------------------------------------------------------------------------------------
# Storage order of the layers


def _reorder(x, first: int, second: int):
    """[first·second·K, ...] viewed as [first, second, K, ...] -> [second, first, K, ...], flattened back."""
    k = x.shape[0] // (first * second)
    return x.reshape(first, second, k, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)


def to_storage_order(layers_tree, stages: int, repeats: int):
    """Layer leaves [L, ...] in natural order -> storage order (groups r·P + p stored at block (p, r))."""
    if _is_natural(stages, repeats):
        return layers_tree
    return _map_layer_leaves(lambda x: _reorder(x, repeats, stages), layers_tree)


def to_natural_order(layers_tree, stages: int, repeats: int):
    """The inverse of to_storage_order."""
    if _is_natural(stages, repeats):
        return layers_tree
    return _map_layer_leaves(lambda x: _reorder(x, stages, repeats), layers_tree)


def relayout(tree, saved: tuple[int, int], wanted: tuple[int, int]):
    """A state or params restored from a checkpoint written with pipeline layout `saved` (stages, repeats),
    in the storage order of layout `wanted`: each layer leaf reordered on its devices, keeping its sharding."""
    if _is_natural(*saved) and _is_natural(*wanted) or saved == wanted:
        return tree

    def move(x):
        x = x if _is_natural(*saved) else _reorder(x, saved[0], saved[1])  # to the natural order
        return x if _is_natural(*wanted) else _reorder(x, wanted[1], wanted[0])  # to the wanted storage order

    return _map_layer_leaves(lambda x: jax.jit(move, out_shardings=x.sharding)(x), tree)


def _is_natural(stages: int, repeats: int) -> bool:
    return stages == 1 or repeats == 1


def _map_layer_leaves(fn, tree):
    """Apply fn to every leaf under a "layers" key (params and the optimizer moments that mirror them)."""
    def visit(path, leaf):
        in_layers = any(isinstance(key, jax.tree_util.DictKey) and key.key == "layers" for key in path)
        return fn(leaf) if in_layers and getattr(leaf, "ndim", 0) > 0 else leaf
    return jax.tree_util.tree_map_with_path(visit, tree)


# ---------------------------------------------------------------------------------------------
# The schedule


def without_stage_axis(rules: tuple) -> tuple:
    """The logical-axis rules inside a stage, where the pipeline axis is manual: it is dropped from every entry."""
    def drop(axes):
        if axes is None or axes == STAGE_AXIS:
            return None
        if isinstance(axes, str):
            return axes
        kept = tuple(a for a in axes if a != STAGE_AXIS)
        return kept or None
    return tuple((name, drop(axes)) for name, axes in rules)


def run_stages(layout: PipelineLayout, stage: Callable, layer_params, x, segment_ids, positions,
               names: tuple[str, ...]) -> jax.Array:
    """The whole layer stack over a batch: x [B, T, D] (embeddings), segment_ids, positions [B, T] -> [B, T, D].

    stage(layer_params [K, ...], x, segment_ids, positions) runs one group of K layers on one micro-batch;
    `names` are the logical axis names of the activations between layers (their sharding within a stage).
    Micro-batch m holds rows m, m + M, m + 2M, ... (as gradient accumulation splits a batch). The result
    has its batch split over the stages too.
    """
    stages, repeats, microbatches = layout.stages, layout.repeats, layout.microbatches
    rows = x.shape[0] // microbatches
    take = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)  # noqa: E731
    split = lambda a: a.reshape(rows, microbatches, *a.shape[1:]).swapaxes(0, 1)  # noqa: E731 - [M, rows, T]
    inner_rules = without_stage_axis(nn.get_logical_axis_rules())

    def pin(a):
        """Every micro-batch's activations sharded alike within a stage, whichever buffer holds them."""
        return nn.with_logical_constraint(a, (None,) * (a.ndim - len(names)) + names, rules=inner_rules)

    dtype = x.dtype

    def local(layer_params, inputs, segment_ids, positions):
        index = jax.lax.axis_index(STAGE_AXIS)
        inputs = inputs.astype(dtype)
        groups = jax.tree.map(lambda w: w.reshape(repeats, w.shape[0] // repeats, *w.shape[1:]), layer_params)

        def iteration(carry, t):
            x, kept = carry  # x: this stage's input [rows, T, D]; kept: stage 0's micro-batches [M, rows, T, D]
            # What reached stage 0 from the last stage: micro-batch (t - P) mod M, kept for its next repeat.
            arrived = (t - stages) % microbatches
            keep = (index == 0) & (t >= stages)
            kept = jax.lax.dynamic_update_index_in_dim(kept, jnp.where(keep, x, take(kept, arrived)), arrived, 0)
            first = t % microbatches
            x = jnp.where(index == 0, jnp.where(t < microbatches, take(inputs, first), take(kept, first)), x)
            # This stage's micro-batch and repeat (outside 0 <= t - index < M·R the stage idles on stale data).
            mine = (t - index) % microbatches
            repeat = jnp.clip((t - index) // microbatches, 0, repeats - 1)
            weights = jax.tree.map(lambda w: take(w, repeat), groups)
            with nn.logical_axis_rules(inner_rules):
                x = stage(weights, x, take(segment_ids, mine), take(positions, mine))
            x = jax.lax.ppermute(x, STAGE_AXIS, [(i, (i + 1) % stages) for i in range(stages)])
            return (pin(x), pin(kept)), None

        inputs = pin(inputs)
        start = (pin(jnp.zeros_like(inputs[0])), pin(jnp.zeros_like(inputs)))
        (x, kept), _ = jax.lax.scan(iteration, start, jnp.arange(layout.iterations))
        last = (layout.iterations - stages) % microbatches  # the final micro-batch, arriving after the loop
        kept = jax.lax.dynamic_update_index_in_dim(kept, jnp.where(index == 0, x, take(kept, last)), last, 0)
        # Stage 0 holds every micro-batch's output; each stage takes M/P of them for the loss.
        outputs = jnp.where(index == 0, kept, 0).astype(summed)
        return jax.lax.psum_scatter(outputs, STAGE_AXIS, scatter_dimension=0, tiled=True).astype(dtype)

    # Embeddings enter every stage whole (only stage 0 reads them): gathered over the stages here; their
    # gradient is summed over the stages in the backward pass. XLA:CPU cannot compile a sum over a manual
    # axis in bf16 (its all-reduce promotion pass aborts on the reducer jax emits), so on CPUs the stages'
    # sums run in fp32.
    summed = jnp.float32 if platform.backend() == "cpu" and dtype == jnp.bfloat16 else dtype
    x = pin(x).astype(summed)
    stage_specs = PartitionSpec(STAGE_AXIS)
    out = jax.shard_map(local, in_specs=(stage_specs, PartitionSpec(), PartitionSpec(), PartitionSpec()),
                        out_specs=stage_specs, axis_names={STAGE_AXIS}, check_vma=False)(
        layer_params, split(x), split(segment_ids), split(positions))
    return out.swapaxes(0, 1).reshape(x.shape).astype(dtype)
