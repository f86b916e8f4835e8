"""Pipeline parallelism's layout: the layer stack cut into stages over the mesh's `pipeline` axis, and the
micro-batch splits both schedules share.

Which layers each stage holds, and the order they are stored in, is stages.py's: with mesh.pipeline = P stages
and mesh.pipeline_repeats = R, each device holds R groups of layers that are P groups apart (the circular, or
interleaved, schedule; R = 1: one group per stage), as many layers in each or as mesh.pipeline_stage_layers
says. A pass through the pipeline carries M micro-batches (mesh.pipeline_microbatches, or all of
train.microbatches; the step accumulates the gradient over the passes), which flow through the stages inside
the one jitted step, in one of two schedules (mesh.pipeline_schedule), each a way of running the layer stack
(stack/):

  gpipe   (stack/gpipe.py) every micro-batch's forward pass through every stage, then autodiff back through the
          loop: each stage keeps its inputs of all M micro-batches until the backward pass (fewer with
          recomputation; passes of fewer micro-batches bound it).
  1f1b    (stack/one_f_one_b.py) each iteration a stage runs one micro-batch's forward pass and an earlier one's
          backward pass, with explicit VJPs: a stage keeps at most about 2P micro-batches in flight, whatever M.

Both loop over iterations in a shard_map over the pipeline axis alone: inside a stage the pipeline axis is
manual and the other axes stay automatic, so fsdp, tensor (and sequence parallelism) and sequence work within
each stage as without pipelining.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from llama_jax.config import MeshConfig
from llama_jax.model.stages import LayerOrder

STAGE_AXIS = "pipeline"


def pass_microbatches(mesh: MeshConfig, microbatches: int) -> int:
    """Micro-batches per pass through the pipeline: mesh.pipeline_microbatches, or all `microbatches` of the step."""
    return mesh.pipeline_microbatches or microbatches


def fewest_microbatches(mesh: MeshConfig, stages: int) -> int:
    """The fewest micro-batches a step may have on `stages` pipeline stages: 1 without a pipeline; with one, a
    multiple of the stages and of mesh.pipeline_microbatches (where train.microbatches=auto begins)."""
    return math.lcm(stages, mesh.pipeline_microbatches or 1) if stages > 1 else 1


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
        """Of the schedule's loop (GPipe's; one_f_one_b_schedule.iterations for 1F1B)."""
        return self.microbatches * self.repeats + self.stages - 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of the step a stage waits, in either schedule: (P - 1) / (M·R + P - 1)."""
    return (stages - 1) / (microbatches * repeats + stages - 1)


# ---------------------------------------------------------------------------------------------
# Inside the stages: their logical-axis rules, micro-batches and groups of layers


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


def by_owner(stages: int, microbatches: int, rules: tuple, mesh_shape: Mapping[str, int]) -> tuple[Callable, Callable]:
    """(split, merge): [B, ...] -> [M/P, P, B/M, ...], micro-batch i·P + p kept by stage p (1F1B), and back.

    Where the batch is split over the data axes and then the stages (the logical-axis table's `batch` rule
    ends with the pipeline axis), micro-batch i·P + p is made of rows stage p already holds: of each data
    shard's p-th block, the rows r·M/P + i. Nothing moves between devices. Otherwise micro-batch m holds rows
    m, m + M, ... (as `microbatched`), moved there. rules, mesh_shape: the trace's (TraceContext)."""
    P, M = stages, microbatches
    axes = dict(rules).get("batch")
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    if not axes or axes[-1] != STAGE_AXIS:
        return (
            lambda a: microbatched(a, M).reshape(M // P, P, a.shape[0] // M, *a.shape[1:]),
            lambda a: unmicrobatched(a.reshape(M, *a.shape[2:])),
        )
    shards = math.prod(mesh_shape[axis] for axis in axes[:-1])
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


def summed_dtype(dtype, platform: str) -> jnp.dtype:
    """The dtype of sums over the stages on `platform` (the trace's). XLA:CPU cannot compile a sum over a manual
    axis in bf16 (its all-reduce promotion pass aborts on the reducer jax emits), so on CPUs they run in fp32."""
    return jnp.float32 if platform == "cpu" and dtype == jnp.bfloat16 else dtype
