"""The optimizer: AdamW with a learning rate schedule (warmup, then cosine or warmup-stable-decay, then an optional
linear decay phase), and global-norm clipping."""

from __future__ import annotations

import jax
import optax

from llama_jax.config import TrainConfig


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


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    steps = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
    steps.append(
        optax.adamw(
            learning_rate(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=weight_decay_mask(t)
        )
    )
    return optax.chain(*steps)
