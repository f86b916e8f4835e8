"""P-tuning's prompt encoder (peft.method=ptuning): the virtual tokens [prompt_tokens, embed] as learned inputs
passed through an MLP, or through a bidirectional LSTM and then the MLP (Liu et al. 2021), so that the tokens of
a prompt are trained together rather than each on its own. After training only its output is kept
(peft.inference_params): inference runs a prompt-tuned model.

The LSTM is written here rather than taken from nnx.OptimizedLSTMCell, which stores the four gates' kernels as
one [in, 4 x hidden] matrix: its gates keep one kernel each (`ii` ... `io` for the input, `hi` ... `ho` with
their biases for the hidden state), as P-tuning checkpoints have held them since the model was written in Linen,
and it computes them as Linen's OptimizedLSTMCell did (the kernels concatenated, one product per input), so
that such a run resumes bit for bit.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from llama_jax.config import ModelConfig, PeftConfig
from llama_jax.model.params import abstract, named, param

GATES = ("i", "f", "g", "o")  # input, forget, cell and output gates


def lstm_gates(features: int, hidden: int, dtype, rngs: nnx.Rngs) -> nnx.Dict:
    """One direction's kernels, by gate: `ii` ... `io` [features, hidden] for the input, `hi` ... `ho` [hidden,
    hidden] with their biases for the hidden state (in nnx.Linear, never called: lstm() uses them together)."""
    dense = partial(
        nnx.Linear, param_dtype=dtype, bias_init=named(nnx.initializers.zeros, ("prompt_hidden",)), rngs=rngs
    )
    inputs = named(nnx.initializers.lecun_normal(), ("embed", "prompt_hidden"))
    recurrent = named(nnx.initializers.orthogonal(), ("prompt_hidden", None))
    return nnx.Dict(
        {f"i{g}": dense(features, hidden, use_bias=False, kernel_init=inputs) for g in GATES}
        | {f"h{g}": dense(hidden, hidden, kernel_init=recurrent) for g in GATES}
    )


def lstm(gates: nnx.Dict, x: jax.Array, reverse: bool = False) -> jax.Array:
    """The LSTM of `gates` over x [1, T, features] (backwards with `reverse`) -> hidden states [1, T, hidden]."""
    by_input, by_hidden = [gates[f"i{g}"] for g in GATES], [gates[f"h{g}"] for g in GATES]

    def step(carry, x_t):  # x_t [1, features]; each gate is W_h h + b + W_i x, its kernels concatenated
        c, h = carry
        recurrent = jnp.dot(h, jnp.concatenate([d.kernel[...] for d in by_hidden], -1))
        recurrent = jnp.split(recurrent + jnp.concatenate([d.bias[...] for d in by_hidden])[None], 4, -1)
        inputs = jnp.split(jnp.dot(x_t, jnp.concatenate([d.kernel[...] for d in by_input], -1)), 4, -1)
        i, f, g, o = (a + b for a, b in zip(recurrent, inputs))
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (c, h), h

    kernel = by_hidden[0].kernel
    zeros = jnp.zeros((x.shape[0], kernel.shape[0]), kernel.dtype)
    steps = jnp.swapaxes(jnp.flip(x, axis=1) if reverse else x, 0, 1)  # [T, 1, features]
    outputs = jnp.swapaxes(jax.lax.scan(step, (zeros, zeros), steps)[1], 0, 1)
    return jnp.flip(outputs, axis=1) if reverse else outputs


class PromptEncoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, peft: PeftConfig, rngs: nnx.Rngs):
        hidden, dtype = peft.encoder_hidden or cfg.d_model, jnp.dtype(cfg.param_dtype)
        self.recurrent = peft.prompt_encoder == "lstm"
        shape, names = (peft.prompt_tokens, cfg.d_model), ("virtual_tokens", "embed")
        self.embedding = param(rngs, nnx.initializers.normal(cfg.init_std), shape, names, dtype)
        if self.recurrent:
            self.forward_lstm = lstm_gates(cfg.d_model, hidden, dtype, rngs)
            self.backward_lstm = lstm_gates(cfg.d_model, hidden, dtype, rngs)
        # After the LSTM the input's features are both directions' hidden states: not named again (a name appears
        # once per array).
        features, first = (2 * hidden, None) if self.recurrent else (cfg.d_model, "embed")
        dense = partial(nnx.Linear, param_dtype=dtype, rngs=rngs)
        kernels, biases = nnx.initializers.lecun_normal(), nnx.initializers.zeros
        self.hidden = dense(
            features,
            hidden,
            kernel_init=named(kernels, (first, "prompt_hidden")),
            bias_init=named(biases, ("prompt_hidden",)),
        )
        self.output = dense(
            hidden,
            cfg.d_model,
            kernel_init=named(kernels, ("prompt_hidden", "embed")),
            bias_init=named(biases, ("embed",)),
        )

    def __call__(self) -> jax.Array:
        """[prompt_tokens, embed]: the virtual tokens' embeddings."""
        x = self.embedding[...]
        if self.recurrent:
            both = (lstm(self.forward_lstm, x[None]), lstm(self.backward_lstm, x[None], reverse=True))
            x = jnp.concatenate(both, axis=-1)[0]  # [prompt_tokens, 2 x hidden]
        return self.output(nnx.relu(self.hidden(x)))


def encoded_prompt(cfg: ModelConfig, peft: PeftConfig, params: dict) -> jax.Array:
    """[prompt_tokens, embed]: what the encoder with `params` (the model's params["prompt_encoder"]) computes."""
    graph = nnx.graphdef(abstract(lambda: PromptEncoder(cfg, peft, nnx.Rngs(0))))
    return nnx.merge(graph, params)()
