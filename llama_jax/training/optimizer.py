"""The optimizer: AdamW (train.optimizer=adamw), or Muon for the hidden matrices and AdamW for the rest
(train.optimizer=muon); with a learning rate schedule (warmup, then cosine or warmup-stable-decay, then an optional
linear decay phase), and global-norm clipping.

Muon (Keller Jordan, 2024; at scale: Liu et al., "Muon is Scalable for LLM Training", 2025) keeps one momentum per
matrix and steps along its orthogonalized direction: the momentum's nearest semi-orthogonal matrix, approximated
by a few Newton-Schulz iterations, scaled so that its RMS is AdamW's (train.muon.rms_scale). The matrices are the
layers' attention and MLP projections, each layer's on its own (the stack's layer axis is a batch axis); the
embedding, the output projection, the norms and a peft run's adapters stay on AdamW, as in the papers. Its momentum
follows optax.contrib.scale_by_muon's; what optax's Muon lacks, and is written here, is where the iterations run: a
sharded matrix is first gathered whole onto the devices of its layer (sharding.whole_matrices), so that no collective
runs inside the iterations and the update is one device's, and the Newton-Schulz coefficients come from the config
each step rather than from the checkpointed state.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from llama_jax.config import MuonConfig, TrainConfig
from llama_jax.distributed.sharding import whole_matrices
from llama_jax.model.llama import param_shapes
from llama_jax.model.params import is_param

# A layer's projections that Muon orthogonalizes -> how many of its axes after the layer axis are the matrix's
# input (rows); the rest are its output (columns). q_proj [layers, embed, heads, head_dim] is one
# embed x (heads * head_dim) matrix per layer, o_proj [layers, heads, head_dim, embed] one (heads * head_dim) x embed.
MATRIX_INPUT_AXES = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1}


def learning_rate(t: TrainConfig) -> optax.Schedule:
    """Linear warmup to lr; then cosine towards lr * min_lr_ratio at step train.steps (cosine), or lr held (wsd); then,
    over the decay phase (the last train.decay_steps), linearly from the lr reached to lr * min_lr_ratio, which the
    schedule takes at step train.steps exactly (the value after the last update: a final lr of 0 wastes no update).

    Warmup starts at lr / (warmup_steps + 1), not 0, so the first step already updates the model.
    """
    warmup, decay, final = t.resolved_warmup_steps, t.resolved_decay_steps, t.lr * t.min_lr_ratio
    if t.schedule == "wsd":
        ramp = optax.linear_schedule(t.lr / (warmup + 1), t.lr, warmup)
        main = optax.join_schedules([ramp, optax.constant_schedule(t.lr)], [warmup])
    else:
        main = optax.warmup_cosine_decay_schedule(
            init_value=t.lr / (warmup + 1),
            peak_value=t.lr,
            warmup_steps=warmup,
            decay_steps=max(t.steps, warmup + 1),  # optax counts warmup inside decay_steps
            end_value=final,
        )
    if decay == 0:
        return main
    begin = t.steps - decay
    with jax.ensure_compile_time_eval():  # a number also when the optimizer is built inside a traced function
        reached = float(main(begin))
    return optax.join_schedules([main, optax.linear_schedule(reached, final, decay)], [begin])


def weight_decay_mask(t: TrainConfig):
    """Which params get weight decay: matmul weights yes; embeddings and norm scales only if asked.

    Decaying norm scales pulls them towards 0 (not their init of 1), and decaying the embedding
    table shrinks rare tokens' rows, which get few gradient updates to counter it.
    """

    def decays(path, _leaf) -> bool:
        names = {getattr(key, "key", str(key)) for key in path}
        if "embedding" in names:
            return t.decay_embeddings
        if "scale" in names:
            return t.decay_norms
        return True

    return lambda params: jax.tree_util.tree_map_with_path(decays, params)


def schedule_count(opt_state) -> jax.Array:
    """The optimizer's own step count, whose learning rate schedule(count) its next update applies. It lags the
    train state's step after a skipped (non-finite) step, which leaves the optimizer state as it was."""
    states = jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByScheduleState))
    return next(s.count for s in states if isinstance(s, optax.ScaleByScheduleState))


def make_optimizer(t: TrainConfig, placements: dict | None = None) -> optax.GradientTransformation:
    """train.optimizer's transformation, after global-norm clipping. `placements` (muon_placements): where each
    hidden matrix's Newton-Schulz iterations run on a mesh; None on one device."""
    steps = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
    adamw = optax.adamw(
        learning_rate(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=weight_decay_mask(t)
    )
    if t.optimizer == "muon":
        muon = optax.chain(
            scale_by_muon(t.muon, placements or {}),
            optax.add_decayed_weights(t.weight_decay),  # every hidden matrix decays, as under AdamW
            optax.scale_by_learning_rate(learning_rate(t)),
        )
        steps.append(optax.partition({"muon": muon, "adamw": adamw}, optimizer_labels))
    else:
        steps.append(adamw)
    return optax.chain(*steps)


def state_bytes_per_param(config) -> float:
    """Bytes of train state per parameter of `config`'s model (float32): the parameter and AdamW's two moments,
    or, under Muon, one momentum for a hidden matrix's and AdamW's two for the others'."""
    if config.train.optimizer != "muon":
        return 12.0
    params = jax.tree_util.tree_leaves_with_path(param_shapes(config.model))
    sizes = [(matrix_name(path), math.prod(leaf.shape)) for path, leaf in params]
    total = sum(size for _, size in sizes)
    return 4.0 + sum((4.0 if matrix else 8.0) * size for matrix, size in sizes) / total


def matrix_name(path) -> str | None:
    """The projection a parameter's path names, if it is one of the stacked layers' hidden matrices."""
    names = _keys(path)
    if names[:1] != ("layers",) or names[-1:] != ("kernel",):
        return None
    return next((name for name in names if name in MATRIX_INPUT_AXES), None)


def optimizer_labels(params) -> Any:
    """Each parameter's optimizer under train.optimizer=muon: "muon" for the hidden matrices, else "adamw"."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "muon" if matrix_name(path) else "adamw", params, is_leaf=is_param
    )


def muon_placements(
    param_shardings: Any, mesh: Mesh, layers: int
) -> dict[tuple[str, ...], tuple[NamedSharding, NamedSharding]]:
    """Each hidden matrix's path -> (where its stack of `layers` matrices, as stored, is orthogonalized whole, where
    its update goes back: the parameter's sharding), from the parameters' shardings on `mesh`
    (sharding.whole_matrices)."""
    return {
        _keys(path): (NamedSharding(mesh, whole_matrices(placed.spec, layers, mesh)), placed)
        for path, placed in jax.tree_util.tree_leaves_with_path(param_shardings)
        if matrix_name(path)
    }


class MuonState(NamedTuple):
    count: jax.Array  # updates made, for the momentum's bias correction
    mu: Any  # each matrix's momentum


def scale_by_muon(m: MuonConfig, placements: dict) -> optax.GradientTransformation:
    """Muon's direction for each hidden matrix: its Nesterov momentum (as optax.contrib.scale_by_muon keeps it),
    orthogonalized by Newton-Schulz and scaled to AdamW's RMS, rms_scale x sqrt(max(rows, cols))."""

    def init(params):
        return MuonState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params))

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, m.momentum, 1)
        count = optax.safe_increment(state.count)
        if m.nesterov:
            direction = jax.tree.map(
                lambda v, g: m.momentum * v + (1 - m.momentum) * g,
                optax.tree.bias_correction(mu, m.momentum, optax.safe_increment(count)),
                optax.tree.bias_correction(updates, m.momentum, count),
            )
        else:
            direction = optax.tree.bias_correction(mu, m.momentum, count)
        with jax.named_scope("muon"):
            orthogonal = jax.tree_util.tree_map_with_path(
                lambda path, d: orthogonalized(d, MATRIX_INPUT_AXES[matrix_name(path)], m, placements.get(_keys(path))),
                direction,
            )
        return orthogonal, MuonState(count=count, mu=mu)

    return optax.GradientTransformation(init, update)


def orthogonalized(direction: jax.Array, inputs: int, m: MuonConfig, placed: tuple | None) -> jax.Array:
    """A stack of matrices [layers, *input axes, *output axes] -> each layer's Newton-Schulz orthogonalization,
    scaled. Where `placed`, the iterations run in a shard_map over whole matrices (sharding.whole_matrices): each
    device orthogonalizes its layers' matrices alone, so nothing is communicated inside them (left to the
    partitioner, the matmuls were split over fsdp and gathered at every iteration), and the update is put back
    in the parameter's sharding."""
    layers, *axes = direction.shape
    rows, cols = math.prod(axes[:inputs]), math.prod(axes[inputs:])
    scale = m.rms_scale * math.sqrt(max(rows, cols))

    def orthogonalize(matrices):
        return jax.vmap(lambda x: newton_schulz(x, m.ns_coefficients, m.ns_steps))(matrices) * scale

    matrices = direction.reshape(layers, rows, cols)
    if not placed:
        return orthogonalize(matrices).reshape(direction.shape)
    whole, parameter = placed
    local = jax.shard_map(orthogonalize, mesh=whole.mesh, in_specs=whole.spec, out_specs=whole.spec)
    update = local(jax.lax.with_sharding_constraint(matrices, whole)).reshape(direction.shape)
    return jax.lax.with_sharding_constraint(update, parameter)


def newton_schulz(x: jax.Array, coefficients, steps: int, eps: float = 1e-8) -> jax.Array:
    """x [rows, cols] -> approximately its nearest semi-orthogonal matrix U V^T (x = U S V^T): the quintic
    iteration X <- a X + b (X X^T) X + c (X X^T)^2 X from X = x / |x|_F, on the wide orientation (X X^T is the
    smaller Gram matrix). Jordan's coefficients give U S' V^T with S' in about [0.7, 1.2], which trains as well."""
    a, b, c = coefficients
    wide = x.T if x.shape[0] > x.shape[1] else x
    wide = wide / (jnp.linalg.norm(wide) + eps)
    for _ in range(steps):
        gram = wide @ wide.T
        wide = a * wide + (b * gram + c * gram @ gram) @ wide
    return wide.T if x.shape[0] > x.shape[1] else wide


def _keys(path) -> tuple[str, ...]:
    return tuple(getattr(key, "key", str(key)) for key in path)
