"""Pipeline parallelism: the layer stack cut into stages over the mesh's `pipeline` axis, and the GPipe schedule.

Which layers each stage holds, and the order they are stored in, is stages.py's: with mesh.pipeline = P stages
and mesh.pipeline_repeats = R, each device holds R groups of layers that are P groups apart (the circular, or
interleaved, schedule; R = 1: one group per stage), as many layers in each or as mesh.pipeline_stage_layers
says. A pass through the pipeline carries M micro-batches (mesh.pipeline_microbatches, or all of
train.microbatches; the step accumulates the gradient over the passes), which flow through the stages inside
the one jitted step, in one of two schedules (mesh.pipeline_schedule):

  gpipe (here)  every micro-batch's forward pass through every stage, then autodiff back through the loop:
                each stage keeps its inputs of all M micro-batches until the backward pass (fewer with
                recomputation; passes of fewer micro-batches bound it).
  1f1b          (one_f_one_b.py) each iteration a stage runs one micro-batch's forward pass and an earlier
                one's backward pass, with explicit VJPs: a stage keeps at most about 2P micro-batches in flight,
                whatever M.

The GPipe loop:

    iteration t:  stage p runs micro-batch (t - p) mod M through its group of repeat (t - p) // M,
                  then every stage hands its output to the next (a collective permute); the last
                  stage's output wraps around to stage 0, which keeps it for the micro-batch's next
                  repeat (or, after the last repeat, as its final output).

Stage 0 takes micro-batch t's embeddings for t < M; they are looked up before the loop with the batch split
over all the devices, as without pipelining, and gathered over the stages (XLA's partitioner cannot split
the lookup's gather inside a stage, where the pipeline axis is manual, in every layout). The loop runs
M·R + P - 1 iterations, of which each stage works M·R: the bubble is (P - 1) / (M·R + P - 1) of the pass.
Gradients flow back through the same loop by autodiff, so clipping and the non-finite-step guard see the
whole batch's gradient as before.

After the loop stage 0 holds every micro-batch's final activations; a reduce-scatter hands each stage
M/P of them, so the output projection and the loss are computed once, spread over the stages: the
embedding and the output projection live on every stage (sharded over fsdp and tensor like the rest,
replicated over pipeline), used by stage 0 and by all stages' share of the loss respectively.

Inside a stage the pipeline axis is manual (a shard_map over it alone); the other axes stay automatic,
so fsdp, tensor (and sequence parallelism) and sequence work within each stage as without pipelining.
A stage with fewer layers than its places (uneven stages) skips the empty places' compute.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from llama_jax.model import platform
from llama_jax.model.stages import LayerOrder

STAGE_AXIS = "pipeline"
LAYER_SLOT_SCOPE = "pipeline_layer_slot"  # the name of the conditional that skips an empty slot (uneven stages)


@dataclass(frozen=True)
class PipelineLayout:
    stages: int  # P: devices along the pipeline axis
    repeats: int  # R: groups of layers per device
    microbatches: int  # M: micro-batches per pass (a multiple of P)
    schedule: str = "gpipe"  # gpipe | 1f1b
    group_layers: tuple[int, ...] = ()  # layers of group r·P + p (stages.py); () = as many in each

    @property
    def order(self) -> LayerOrder:
        return LayerOrder(self.stages, self.repeats, self.group_layers)

    @property
    def iterations(self) -> int:
        """Of the schedule's loop (GPipe's; one_f_one_b.iterations for 1F1B)."""
        return self.microbatches * self.repeats + self.stages - 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of the step a stage waits, in either schedule: (P - 1) / (M·R + P - 1)."""
    return (stages - 1) / (microbatches * repeats + stages - 1)


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


def microbatched(a: jax.Array, microbatches: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...]: micro-batch m holds rows m, m + M, m + 2M, ... (as gradient accumulation
    splits a batch, so every device's rows contribute to every micro-batch)."""
    return a.reshape(a.shape[0] // microbatches, microbatches, *a.shape[1:]).swapaxes(0, 1)


def unmicrobatched(a: jax.Array) -> jax.Array:
    """The inverse of microbatched."""
    return a.swapaxes(0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def by_owner(stages: int, microbatches: int) -> tuple[Callable, Callable]:
    """(split, merge): [B, ...] -> [M/P, P, B/M, ...], micro-batch i·P + p kept by stage p (1F1B), and back.

    Where the batch is split over the data axes and then the stages (the logical-axis table's `batch` rule
    ends with the pipeline axis), micro-batch i·P + p is made of rows stage p already holds: of each data
    shard's p-th block, the rows r·M/P + i. Nothing moves between devices. Otherwise micro-batch m holds rows
    m, m + M, ... (as `microbatched`), moved there."""
    P, M = stages, microbatches
    axes = dict(nn.get_logical_axis_rules()).get("batch")
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    if not axes or axes[-1] != STAGE_AXIS:
        return (lambda a: microbatched(a, M).reshape(M // P, P, a.shape[0] // M, *a.shape[1:]),
                lambda a: unmicrobatched(a.reshape(M, *a.shape[2:])))
    shards = math.prod(jax.sharding.get_abstract_mesh().shape[axis] for axis in axes[:-1])
    order = (2, 1, 3, 0)  # [shards, P, rows, M/P] -> [M/P, P, shards, rows]

    def split(a):
        rows = a.shape[0] // (shards * M)  # of a micro-batch in each data shard
        a = jnp.moveaxis(a.reshape(shards, P, rows, M // P, *a.shape[1:]), (0, 1, 2, 3), order)
        return a.reshape(M // P, P, shards * rows, *a.shape[4:])

    def merge(a):
        a = jnp.moveaxis(a.reshape(M // P, P, shards, a.shape[2] // shards, *a.shape[3:]), order, (0, 1, 2, 3))
        return a.reshape(-1, *a.shape[4:])
    return split, merge


def stage_groups(layout: PipelineLayout, layer_params):
    """A stage's block of layer leaves [R·slots, ...] -> [R, slots, ...], and a function (stage index,
    repeat) -> how many of that group's slots hold layers (None when every group fills its slots)."""
    length = jax.tree.leaves(layer_params)[0].shape[0]
    groups = jax.tree.map(lambda w: w.reshape(layout.repeats, length // layout.repeats, *w.shape[1:]), layer_params)
    if not layout.group_layers:
        return groups, lambda index, repeat: None
    counts = layout.order.stage_layers(sum(layout.group_layers))  # [P, R]
    return groups, lambda index, repeat: jnp.asarray(counts, jnp.int32)[index, repeat]


def summed_dtype(dtype) -> jnp.dtype:
    """The dtype of sums over the stages. XLA:CPU cannot compile a sum over a manual axis in bf16 (its
    all-reduce promotion pass aborts on the reducer jax emits), so on CPUs they run in fp32."""
    return jnp.float32 if platform.backend() == "cpu" and dtype == jnp.bfloat16 else dtype


def run_stages(layout: PipelineLayout, stage: Callable, layer_params, x, segment_ids, positions,
               names: tuple[str, ...]) -> jax.Array:
    """GPipe: the whole layer stack over a batch: x [B, T, D] (embeddings), segment_ids, positions [B, T] ->
    [B, T, D].

    stage(layer_params [slots, ...], layers, x, segment_ids, positions) runs one group of layers on one
    micro-batch (`layers`: how many of the slots hold layers, or None for all); `names` are the logical axis
    names of the activations between layers (their sharding within a stage). The result has its batch
    split over the stages too.
    """
    stages, repeats, microbatches = layout.stages, layout.repeats, layout.microbatches
    take = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)  # noqa: E731
    inner_rules = without_stage_axis(nn.get_logical_axis_rules())

    def pin(a):
        """Every micro-batch's activations sharded alike within a stage, whichever buffer holds them."""
        return nn.with_logical_constraint(a, (None,) * (a.ndim - len(names)) + names, rules=inner_rules)

    dtype = x.dtype

    def local(layer_params, inputs, segment_ids, positions):
        index = jax.lax.axis_index(STAGE_AXIS)
        inputs = inputs.astype(dtype)
        groups, layer_count = stage_groups(layout, layer_params)

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
                x = stage(weights, layer_count(index, repeat), x, take(segment_ids, mine), take(positions, mine))
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
    # gradient is summed over the stages in the backward pass (summed_dtype).
    summed = summed_dtype(dtype)
    x = pin(x).astype(summed)
    stage_specs = PartitionSpec(STAGE_AXIS)
    out = jax.shard_map(local, in_specs=(stage_specs, PartitionSpec(), PartitionSpec(), PartitionSpec()),
                        out_specs=stage_specs, axis_names={STAGE_AXIS}, check_vma=False)(
        layer_params, microbatched(x, microbatches), microbatched(segment_ids, microbatches),
        microbatched(positions, microbatches))
    return unmicrobatched(out).astype(dtype)
