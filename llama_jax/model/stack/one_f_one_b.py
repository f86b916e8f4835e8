"""The 1F1B pipeline schedule's loop (mesh.pipeline_schedule=1f1b): one forward, one backward per iteration.

GPipe (gpipe.py) runs every micro-batch's forward pass before autodiff runs the backward passes, so a
stage keeps what its backward passes need for all M micro-batches of a pass. Here each stage, in each
iteration of one loop inside the jitted step, runs one micro-batch's forward pass and an earlier one's
backward pass, with explicit VJPs: what a stage keeps is bounded by the stages, not the micro-batches.

    forward   stage p's input (the embeddings on stage 0 of the first repeat, else what the stage before
              handed on) through its group of layers under jax.vjp; the residuals the remat policy keeps
              (each layer's input under `full`, every activation under `none`) go into slot s of the
              stage's buffers, until that micro-batch's backward pass. Residuals computed from the weights
              and the micro-batch's documents and positions alone are not kept (residuals.py): the backward
              pass computes them again.
    loss      on the last stage of the last repeat, the micro-batch's loss (final norm, output projection,
              cross-entropy) and its gradient, at once: its backward pass starts in the same iteration.
    backward  the VJP of an earlier micro-batch, from its kept residuals and the gradient the stage after
              handed back (or the loss's), accumulating the weights' gradient; on stage 0 of the first
              repeat the gradient of the embeddings, handed to the stage that keeps them (below).

Micro-batch i·P + p's embeddings are kept by stage p, made of rows it already holds (pipeline.by_owner), and
travel one stage per iteration to stage 0 just in time; their gradient travels back to stage p. No stage
holds more than M/P micro-batches' embeddings, and no collective but the permutes between neighbours runs
on them (XLA partitions a reduce-scatter over the manual pipeline axis of a batch split over the others by
replicating it whole).

The tables of the loop (which micro-batch and repeat each stage runs forward and backward in each iteration, and
in which slots) are one_f_one_b_schedule.py's, computed before tracing; every stage runs the same program (SPMD)
and a stage with nothing to do in an iteration skips the work (lax.cond).

The whole pass is a custom_vjp: its forward rule runs this schedule and returns the loss, keeping the
gradients (of the layers, of the loss's weights and of the embeddings) as its residuals; the backward rule
scales them by the loss's cotangent. So the train step differentiates the model as always, and clipping and
the non-finite-step guard see the whole batch's gradient. Without differentiation (evaluation) the pass runs
the forward passes only.

In the code: `_run` splits the batch and runs the loop in a shard_map; there `_Stage` holds one stage's part (its
groups of layers, micro-batches, embeddings and rows of the tables) and an iteration calls its `forward`,
`loss_and_gradient`, `backward_pass` and `drain` in turn, handing the next iteration a `Carry` of named fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from llama_jax.model.pipeline import STAGE_AXIS, by_owner, stage_groups, summed_dtype
from llama_jax.model.residuals import data_dependent
from llama_jax.model.stack.grouped import run_stage
from llama_jax.model.stack.layer import Stack
from llama_jax.model.stack.one_f_one_b_schedule import BACKWARD_SCOPE, FORWARD_SCOPE, LOSS_SCOPE, SLOTS_SCOPE, schedule


def packed(a):
    """A residual as its slot holds it: 16-bit floats as their bits (XLA:CPU updates a 16-bit float buffer in
    place only by converting all of it to fp32 and back, into a copy: twice the memory, and slow)."""
    return jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype in (jnp.bfloat16, jnp.float16) else a


def unpacked(a, dtype):
    return jax.lax.bitcast_convert_type(a, dtype) if a.dtype != dtype else a


def pipelined_loss(stack: Stack, head: Callable) -> Callable:
    """(layer_params, head_params, x, batch) -> the summed loss of the batch, through the 1F1B schedule.

    head(head_params, x, targets, loss_mask, context) -> summed loss of a micro-batch's final activations, traced in
    the stage's context. x [B, T, D] are the embeddings; batch holds targets, loss_mask, segment_ids and positions
    [B, T]. Each stage runs its groups of layers as stack says (grouped.run_stage). Differentiable in layer_params,
    head_params and x.
    """

    @jax.custom_vjp
    def loss(layer_params, head_params, x, batch):
        return _run(stack, head, False, layer_params, head_params, x, batch)

    def forward(layer_params, head_params, x, batch):
        total, *gradients = _run(stack, head, True, layer_params, head_params, x, batch)
        return total, gradients

    def backward(gradients, cotangent):
        scaled = jax.tree.map(lambda g: (g * cotangent).astype(g.dtype), gradients)
        return (*scaled, None)

    loss.defvjp(forward, backward)
    return loss


def _run(stack: Stack, head: Callable, backward: bool, layer_params, head_params, x, batch):
    """The loop in a shard_map over the pipeline axis: the summed loss and, with `backward`, the gradients of
    layer_params, head_params and x."""
    P, M = stack.pipeline.stages, stack.pipeline.microbatches
    dtype = x.dtype

    def local(layer_params, head_params, owned, batch):
        return _Stage(stack, head, backward, dtype, layer_params, head_params, owned, batch).run()

    stage_specs, whole = PartitionSpec(STAGE_AXIS), PartitionSpec()
    # Micro-batch m's embeddings go to stage m mod P ([M/P, P, rows, T, D]); the targets and masks (the last
    # stage reads them) and the documents' ids and positions (every stage), micro-batch by micro-batch, to
    # every stage.
    owners = PartitionSpec(None, STAGE_AXIS)
    split, merge = by_owner(P, M, stack.context.rules, stack.context.mesh_shape)
    x = split(x).astype(summed_dtype(dtype, stack.context.platform))
    batch = {k: split(v).reshape(M, -1, *v.shape[1:]) for k, v in batch.items()}
    out_specs = whole if not backward else (whole, stage_specs, whole, owners)
    out = jax.shard_map(
        local,
        in_specs=(stage_specs, whole, owners, whole),
        out_specs=out_specs,
        axis_names={STAGE_AXIS},
        check_vma=False,
    )(layer_params, head_params, x, batch)
    if not backward:
        return out
    total, d_layers, d_head, d_x = out
    return total, d_layers, d_head, merge(d_x).astype(dtype)


class Carry(NamedTuple):
    """What one iteration of the loop hands the next, on each stage. Activations and gradients [rows, T, D]."""

    act: jax.Array  # the output the stage before handed on: this stage's next input
    grad: jax.Array  # the gradient the stage after handed back
    fed: jax.Array  # embeddings on their way to stage 0
    drained: jax.Array  # the embeddings' gradient on its way from stage 0 to the stage that keeps them
    buffers: list[jax.Array]  # the residual slots: per kept residual, [slots, ...]
    owned: jax.Array  # [M/P, rows, T, D] this stage's micro-batches' embeddings, then their gradients
    d_layers: Any  # the gradient of the stage's groups of layers [R, slots, ...] (None without backward)
    d_head: Any  # of the loss's params, in fp32 (None without backward)
    total: jax.Array  # the summed loss of the micro-batches that left the pipeline on this stage


def _take(a, i):
    return jax.lax.dynamic_index_in_dim(a, i, keepdims=False)


def _put(a, v, i):
    return jax.lax.dynamic_update_index_in_dim(a, v, i, 0)


def _zeros(shapes):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


class _Stage:
    """One stage's part of the loop (inside the shard_map over the pipeline axis): what it holds (its groups of
    layers, the batch's micro-batches, its micro-batches' embeddings, its rows of the tables) and what it does in
    an iteration: a forward pass, the loss on the last stage, a backward pass, and the hand-offs."""

    def __init__(self, stack: Stack, head: Callable, backward: bool, dtype, layer_params, head_params, owned, batch):
        layout = stack.pipeline
        # Traced in the stage's context: the stage axis is manual here.
        self.stack, self.head, self.backward, self.dtype = stack.inside_stage(), head, backward, dtype
        self.P, self.R = layout.stages, layout.repeats
        self.tables = schedule(layout.stages, layout.repeats, layout.microbatches, backward)
        # With repeats the last stage feeds stage 0.
        self.ahead = [(i, (i + 1) % self.P) for i in range(self.P if self.R > 1 else self.P - 1)]
        self.behind = [(b, a) for a, b in self.ahead]
        self.towards_first = [(i + 1, i) for i in range(self.P - 1)]
        self.away_from_first = [(i, i + 1) for i in range(self.P - 1)]
        self.head_params, self.batch = head_params, batch

        self.index = jax.lax.axis_index(STAGE_AXIS)
        self.groups, self.layer_count = stage_groups(layout, layer_params)
        self.columns = {k: jnp.asarray(getattr(self.tables, k)) for k in ("forward", "backward", "feed", "drain")}
        self.owned = self.pin(owned[:, 0].astype(dtype))  # [M/P, rows, T, D]: micro-batches index, index + P, ...
        # Which residuals depend on the stage's input (kept in slots), and which come from the weights and the
        # micro-batch's documents and positions alone (computed again in the backward pass).
        one = self.microbatch(0)
        self.shapes = (
            self.weights(0),
            self.layer_count(self.index, 0),
            self.owned[0],
            one["segment_ids"],
            one["positions"],
        )
        shapes = self.shapes
        self.kept = (
            data_dependent(
                lambda w, c, segment_ids, positions, x: jax.tree.leaves(
                    self.with_vjp(w, c, x, segment_ids, positions)[1]
                ),
                (shapes[0], shapes[1], *shapes[3:]),
                shapes[2:3],
            )
            if backward
            else []
        )
        self.out_shape, vjp_shape = jax.eval_shape(self.with_vjp, *shapes)
        self.saved_shapes = [s for s, k in zip(jax.tree.leaves(vjp_shape), self.kept) if k]

    def pin(self, a):
        """Activations sharded alike within a stage, whichever buffer holds them."""
        return self.stack.constrain(a)

    def row(self, table: str, t) -> list[jax.Array]:
        """This stage's entries of a table at iteration t."""
        columns = self.columns[table]
        return [columns[t, self.index, i] for i in range(columns.shape[-1])]

    def weights(self, repeat):
        return jax.tree.map(lambda w: _take(w, repeat), self.groups)

    def microbatch(self, m) -> dict[str, jax.Array]:
        return {k: _take(v, m) for k, v in self.batch.items()}

    def with_vjp(self, w, layers, x, segment_ids, positions):
        """The stage's output and its VJP (a pytree whose leaves are the residuals)."""
        return jax.vjp(lambda w, x: run_stage(self.stack, w, layers, x, segment_ids, positions), w, x)

    def run_head(self, params, y, m):
        return self.head(params, y, self.microbatch(m)["targets"], self.microbatch(m)["loss_mask"], self.stack.context)

    def run(self):
        """The loop, then (with backward) the last embeddings' gradients on their way to their owners: the summed
        loss and, with backward, the gradients of the stage's layers, of the head's params and of its embeddings."""
        activation = self.pin(jnp.zeros(self.out_shape.shape, self.dtype))
        with jax.named_scope(SLOTS_SCOPE):
            slots = [packed(jnp.zeros((self.tables.slots, *s.shape), s.dtype)) for s in self.saved_shapes]
        start = Carry(
            activation,
            activation,
            activation,
            activation,
            slots,
            self.owned,
            jax.tree.map(jnp.zeros_like, self.groups) if self.backward else None,
            jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), self.head_params) if self.backward else None,
            jnp.zeros((), jnp.float32),
        )
        end, _ = jax.lax.scan(self.iteration, start, jnp.arange(self.tables.iterations))
        total = jax.lax.psum(end.total, STAGE_AXIS)
        if not self.backward:
            return total
        (_, owned), _ = jax.lax.scan(
            lambda carry, t: (self.drain(t, *carry), None),
            (end.drained, end.owned),
            jnp.arange(self.tables.iterations, self.tables.iterations + self.P - 1),
        )
        d_head = jax.tree.map(lambda g, p: jax.lax.psum(g, STAGE_AXIS).astype(p.dtype), end.d_head, self.head_params)
        d_layers = jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), end.d_layers)
        return total, d_layers, d_head, owned[:, None]  # each stage's micro-batches' embedding gradients

    def iteration(self, carry: Carry, t) -> tuple[Carry, None]:
        # The embeddings on their way to stage 0: this stage's own, or those the stage after handed on.
        _, i, own = self.row("feed", t)
        fed = jnp.where(own == 1, _take(carry.owned, i), carry.fed)
        y, buffers, valid, last, m = self.forward(carry.act, fed, carry.buffers, t)
        fed = self.pin(jax.lax.ppermute(fed, STAGE_AXIS, self.towards_first))
        if not self.backward:
            with jax.named_scope(LOSS_SCOPE):
                loss = jax.lax.cond(
                    valid & last,
                    lambda y: self.run_head(self.head_params, y, m),
                    lambda y: jnp.zeros((), jnp.float32),
                    y,
                )
            return carry._replace(
                act=self.pin(jax.lax.ppermute(y, STAGE_AXIS, self.ahead)),
                fed=fed,
                buffers=buffers,
                total=carry.total + loss,
            ), None

        loss, d_params, dy = self.loss_and_gradient(y, valid & last, m, carry.d_head)
        d_head = jax.tree.map(jnp.add, carry.d_head, d_params)
        dx, d_layers = self.backward_pass(carry.grad, dy, buffers, carry.d_layers, t)
        drained, owned = self.drain(t, jnp.where(self.index == 0, dx, carry.drained), carry.owned)
        return Carry(
            self.pin(jax.lax.ppermute(y, STAGE_AXIS, self.ahead)),
            self.pin(jax.lax.ppermute(dx, STAGE_AXIS, self.behind)),
            fed,
            drained,
            buffers,
            owned,
            d_layers,
            d_head,
            carry.total + loss,
        ), None

    def forward(self, act, fed, buffers, t):
        """Iteration t's forward pass, if the stage has one: (output y, the buffers with the residuals it keeps in
        their slot, whether it ran, whether its micro-batch leaves the pipeline here, the micro-batch)."""
        valid, m, r, slot = self.row("forward", t)
        valid, last = valid == 1, (self.index == self.P - 1) & (r == self.R - 1)
        x = jnp.where((self.index == 0) & (r == 0), fed, act)

        def run_forward(x, buffers):
            data = self.microbatch(m)
            y, vjp = self.with_vjp(
                self.weights(r), self.layer_count(self.index, r), x, data["segment_ids"], data["positions"]
            )
            saved = [leaf for leaf, k in zip(jax.tree.leaves(vjp), self.kept) if k]
            with jax.named_scope(SLOTS_SCOPE):  # written in place, in the branch: no copies of a slot
                return y, [_put(b, packed(s), slot) for b, s in zip(buffers, saved)]

        with jax.named_scope(FORWARD_SCOPE):
            y, buffers = jax.lax.cond(valid, run_forward, lambda x, b: (_zeros(self.out_shape), b), x, buffers)
        return y, buffers, valid, last, m

    def loss_and_gradient(self, y, leaving, m, d_head):
        """On the last stage of the last repeat, the micro-batch's loss and its gradients (of the head's params, in
        fp32, and of y): its backward pass starts in the same iteration."""

        def head_and_grads(y):
            loss, (d_params, dy) = jax.value_and_grad(self.run_head, argnums=(0, 1))(self.head_params, y, m)
            return loss, jax.tree.map(lambda g: g.astype(jnp.float32), d_params), dy

        with jax.named_scope(LOSS_SCOPE):
            return jax.lax.cond(
                leaving, head_and_grads, lambda y: (jnp.zeros((), jnp.float32), _zeros(d_head), jnp.zeros_like(y)), y
            )

    def backward_pass(self, grad, dy, buffers, d_layers, t):
        """Iteration t's backward pass, if the stage has one: the gradient of its input, and d_layers with its
        weights' gradient added (in the branch: a skipped backward pass adds no zeros the size of the weights)."""
        valid, m, r, slot = self.row("backward", t)
        valid = valid == 1
        cotangent = jnp.where((self.index == self.P - 1) & (r == self.R - 1), dy, grad)

        def run_backward(cotangent, d_layers):
            # The residuals not kept, again: the forward pass on a zero input is dead code but for them.
            data = self.microbatch(m)
            _, fresh = self.with_vjp(
                self.weights(r),
                self.layer_count(self.index, r),
                jnp.zeros_like(self.shapes[2]),
                data["segment_ids"],
                data["positions"],
            )
            leaves, tree = jax.tree.flatten(fresh)
            stored = iter(unpacked(_take(b, slot), s.dtype) for b, s in zip(buffers, self.saved_shapes))
            vjp = jax.tree.unflatten(tree, [next(stored) if k else leaf for leaf, k in zip(leaves, self.kept)])
            d_weights, dx = vjp(cotangent.astype(self.dtype))
            return dx, jax.tree.map(lambda acc, d: _put(acc, _take(acc, r) + d, r), d_layers, d_weights)

        with jax.named_scope(BACKWARD_SCOPE):
            return jax.lax.cond(valid, run_backward, lambda c, d: (jnp.zeros_like(c), d), cotangent, d_layers)

    def drain(self, t, drained, owned):
        """The embeddings' gradient on its way from stage 0 to the stage that keeps it."""
        valid, i, own = self.row("drain", t)
        owned = _put(owned, jnp.where((valid == 1) & (own == 1), drained, _take(owned, i)), i)
        return self.pin(jax.lax.ppermute(drained, STAGE_AXIS, self.away_from_first)), self.pin(owned)
