"""The train state and the functions the compiled programs are made of: the loss, its gradient over micro-batches,
the train step (program.py jits them for one config on one mesh).

A peft run (peft.method != none) trains adapters on a frozen base model: its state is a PeftState, whose
params and optimizer state are the adapters' only, with the base's params beside them, frozen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from llama_jax.config import Config
from llama_jax.model import peft
from llama_jax.model.attention import select_implementation, skips_masked_blocks
from llama_jax.model.flops import matmul_param_count, train_flops_per_token
from llama_jax.training.optimizer import schedule_count

# The named scope of the optimizer's update in the compiled step (plan.py reports its collectives apart).
OPTIMIZER_SCOPE = "optimizer"


class TrainState(struct.PyTreeNode):
    step: jax.Array
    params: Any  # what learns
    opt_state: Any

    def checkpointed(self) -> TrainState:
        """What a checkpoint of this state holds."""
        return self

    @property
    def model_params(self) -> Any:
        """The params the model runs with."""
        return self.params


class PeftState(TrainState):
    """A peft run's state: params and optimizer state of the adapters only, and the base model's params,
    frozen. The base goes into every step with the rest of the state (donated and returned as it came, so
    XLA aliases its buffers and nothing is copied), but it gets no gradient and no optimizer state, and
    checkpoints leave it out: they reference it (loop.py)."""

    frozen: Any = None

    def checkpointed(self) -> TrainState:
        return TrainState(step=self.step, params=self.params, opt_state=self.opt_state)

    @property
    def model_params(self) -> Any:
        return peft.merge(self.params, self.frozen)


# ---------------------------------------------------------------------------------------------
# Loss and steps (pure functions of their inputs; jitted by TrainProgram)


def loss_terms(
    params, graph: nnx.GraphDef, batch: dict[str, jax.Array], dropout_key: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(summed next-token loss, unmasked token count) of one batch, in fp32, by the model of `graph` (nnx.graphdef
    of a Llama) with `params`. A dropout key (training a peft run with peft.dropout) turns LoRA's dropout on."""
    model = nnx.merge(graph, params)
    return model(
        batch["tokens"],
        batch["positions"],
        batch["segment_ids"],
        targets=batch["targets"],
        loss_mask=batch["loss_mask"],
        dropout_key=dropout_key,
    )


def make_grad_fn(graph: nnx.GraphDef, microbatches: int) -> Callable:
    """(params, batch, frozen, dropout key) -> (mean loss, gradient of the mean loss, token count),
    accumulating the gradient over `microbatches` slices of the batch with a scan. With `frozen` (a peft
    run's base model) the model runs on both, and only `params` (the adapters) are differentiated: no
    weight gradient of the base is ever computed."""

    def loss(params, batch, frozen, key):
        return loss_terms(params if frozen is None else peft.merge(params, frozen), graph, batch, key)

    grad_fn = jax.value_and_grad(loss, has_aux=True)

    def loss_and_grads(params, batch: dict[str, jax.Array], frozen=None, key: jax.Array | None = None):
        if microbatches == 1:
            (loss_sum, count), grad_sum = grad_fn(params, batch, frozen, key)
        else:
            # Microbatch m takes rows m, m + M, m + 2M, ...: every device's slice of the batch
            # contributes to every microbatch, so no device idles while the others accumulate.
            split = jax.tree.map(
                lambda x: x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1), batch
            )

            def accumulate(carry, microbatch_and_index):
                microbatch, index = microbatch_and_index
                microbatch_key = None if key is None else jax.random.fold_in(key, index)
                (loss_sum, count), grads = grad_fn(params, microbatch, frozen, microbatch_key)
                return jax.tree.map(jnp.add, carry, (loss_sum, count, grads)), None

            zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            (loss_sum, count, grad_sum), _ = jax.lax.scan(accumulate, zeros, (split, jnp.arange(microbatches)))
        # Sums divided by the token count of the whole batch: the same gradient whatever the
        # number of microbatches, even when they hold different numbers of unmasked tokens.
        count = jnp.maximum(count, 1.0)
        return loss_sum / count, jax.tree.map(lambda g: g / count, grad_sum), count

    return loss_and_grads


def make_train_step(
    graph: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    microbatches: int,
    dropout_seed: int | None = None,
) -> Callable:
    """The jitted step's function. With dropout_seed, step n's dropout key is (seed, n): a resumed run
    draws the masks a straight run would."""
    loss_and_grads = make_grad_fn(graph, microbatches)

    def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        key = None if dropout_seed is None else jax.random.fold_in(jax.random.key(dropout_seed), state.step)
        frozen = state.frozen if isinstance(state, PeftState) else None
        loss, grads, _ = loss_and_grads(state.params, batch, frozen, key)
        grad_norm = optax.tree.norm(grads)
        with jax.named_scope(OPTIMIZER_SCOPE):  # `plan` counts the collectives under it as the optimizer's
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A non-finite loss or gradient skips the update: params and optimizer moments stay as they
        # were (so a NaN never reaches a checkpoint); the step still counts, the data moves on.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old), (params, opt_state), (state.params, state.opt_state)
        )
        # The rate this step applies: the optimizer counts only the updates it applied.
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": schedule(schedule_count(state.opt_state)),
            "finite": finite,
        }
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def model_flops_per_token(config: Config, platform_name: str | None = None) -> float:
    """train_flops_per_token for the attention kernel this config runs on `platform_name` (default: this process's
    backend). Under context parallelism only
    cuDNN's padded calls skip the masked keys; the XLA kernel in their place computes them all. A peft
    run's frozen weights take part in the forward pass and the input gradients (4 FLOPs per parameter)
    but have no weight gradient (the other 2 of the 6); the adapters' own FLOPs are left out."""
    m = config.model
    kernel = select_implementation(
        m.attention, platform_name or jax.default_backend(), m.compute_dtype, m.resolved_head_dim, config.train.seq_len
    )
    skips = skips_masked_blocks(kernel) and (config.mesh.sequence == 1 or kernel == "cudnn")
    frozen = 2 * matmul_param_count(m) if config.peft.method != "none" else 0
    return train_flops_per_token(m, config.train.seq_len, skips) - frozen
