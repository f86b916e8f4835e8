"""The GPipe schedule (mesh.pipeline_schedule=gpipe): every micro-batch's forward pass through every stage, then
autodiff back through the loop (pipeline.py has the layouts and micro-batch splits both schedules share).

    iteration t:  stage p runs micro-batch (t - p) mod M through its group of repeat (t - p) // M,
                  then every stage hands its output to the next (a collective permute); the last
                  stage's output wraps around to stage 0, which keeps it for the micro-batch's next
                  repeat (or, after the last repeat, as its final output).

Stage 0 takes micro-batch t's embeddings for t < M; they are looked up before the loop with the batch split
over all the devices, as without pipelining, and gathered over the stages (XLA's partitioner cannot split
the lookup's gather inside a stage, where the pipeline axis is manual, in every layout). The loop runs
M·R + P - 1 iterations, of which each stage works M·R: the bubble is (P - 1) / (M·R + P - 1) of the pass.
Gradients flow back through the same loop by autodiff, so clipping and the non-finite-step guard see the
whole batch's gradient as before. Each stage keeps its inputs of all M micro-batches until the backward pass
(fewer with recomputation; passes of fewer micro-batches bound it).

After the loop stage 0 holds every micro-batch's final activations; a reduce-scatter hands each stage
M/P of them, so the output projection and the loss are computed once, spread over the stages: the
embedding and the output projection live on every stage (sharded over fsdp and tensor like the rest,
replicated over pipeline), used by stage 0 and by all stages' share of the loss respectively.

Inside a stage the pipeline axis is manual (a shard_map over it alone); the other axes stay automatic,
so fsdp, tensor (and sequence parallelism) and sequence work within each stage as without pipelining. The
stage's body is traced in its own context (Stack.inside_stage: the pipeline axis out of the rules).
A stage runs its group of layers as grouped.py does; one with fewer layers than its places (uneven stages)
skips the empty places' compute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from llama_jax.model.pipeline import STAGE_AXIS, microbatched, stage_groups, summed_dtype, unmicrobatched
from llama_jax.model.stack.grouped import run_stage
from llama_jax.model.stack.layer import Stack


def run_gpipe(stack: Stack, layer_params, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """The whole layer stack over a batch: x [B, T, D] (embeddings), segment_ids, positions [B, T] -> [B, T, D],
    its batch split over the stages too. layer_params: the stack's, each stage's groups in one block (stages.py)."""
    layout = stack.pipeline
    stages, repeats, microbatches = layout.stages, layout.repeats, layout.microbatches
    take = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)  # noqa: E731
    stage = stack.inside_stage()
    pin = stage.constrain  # every micro-batch's activations sharded alike within a stage, whichever buffer holds them
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
            x = run_stage(stage, weights, layer_count(index, repeat), x, take(segment_ids, mine), take(positions, mine))
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
    summed = summed_dtype(dtype, stack.context.platform)
    x = pin(x).astype(summed)
    stage_specs = PartitionSpec(STAGE_AXIS)
    out = jax.shard_map(
        local,
        in_specs=(stage_specs, PartitionSpec(), PartitionSpec(), PartitionSpec()),
        out_specs=stage_specs,
        axis_names={STAGE_AXIS},
        check_vma=False,
    )(
        layer_params,
        microbatched(x, microbatches),
        microbatched(segment_ids, microbatches),
        microbatched(positions, microbatches),
    )
    return unmicrobatched(out).astype(dtype)
