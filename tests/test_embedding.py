"""The embedding lookup (model/embedding.py): with the table split over its vocabulary alone, each device looks up
its own rows and the rows are summed over the vocabulary's axes; the result and the gradient are jnp.take's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding

from llama_jax.distributed import sharding
from llama_jax.model.context import TraceContext
from llama_jax.model.embedding import lookup
from llama_jax.model.llama import RESIDUAL

VOCAB, EMBED = 64, 16
# The model's table for fsdp x sequence x tensor with sequence parallelism; llama3_405b puts embed over fsdp and
# sequence too. The residual stream splits its sequence over `tensor` as well.
RULES = (
    ("vocab", "tensor"),
    ("embed", ("fsdp", "sequence")),
    ("batch", "fsdp"),
    ("seq", "sequence"),
    ("residual_seq", ("sequence", "tensor")),
    ("act_embed", None),
)
WITHOUT_SEQUENCE_PARALLELISM = (*RULES[:4], ("residual_seq", "sequence"), RULES[5])
TOKENS = ("batch", "seq")


def lookup_and_gradient(mesh, rules, table, tokens, weights):
    """(the compiled program's text, the loss, the table's gradient), every array placed as the rules say."""
    context = TraceContext.on_mesh(mesh, rules)

    def loss(table, tokens, weights):
        x = lookup(context.read(table, ("vocab", "embed")), tokens, context)
        return jnp.sum(context.constrain(x, RESIDUAL) * weights)

    placed = lambda x, names: jax.device_put(x, NamedSharding(mesh, context.mesh_axes(names)))  # noqa: E731
    args = placed(table, ("vocab", "embed")), placed(tokens, TOKENS), placed(weights, (*TOKENS, None))
    with sharding.activate(mesh):
        step = jax.jit(jax.value_and_grad(loss))
        return step.lower(*args).compile().as_text(), *step(*args)


@pytest.mark.parametrize(
    "sequence, rules, vocab_parallel",
    [(2, RULES, True), (2, WITHOUT_SEQUENCE_PARALLELISM, True), (1, RULES, False)],
    ids=["context-parallel", "context-parallel-without-sequence-parallelism", "fsdp"],
)
def test_the_lookup_is_jnp_take_and_splits_the_vocabulary_under_context_parallelism(sequence, rules, vocab_parallel):
    """Context parallelism (sequence 2): `read` gathers embed, so the table is split over `tensor` alone and the
    lookup runs per device (its rows reduce-scattered over `tensor` along the sequence, or summed where sequence
    parallelism is off). Without it the table is split over fsdp as well and the lookup is left to XLA. Either
    way: jnp.take's values and gradient."""
    mesh = jax.make_mesh(
        (2, sequence, 2),
        ("fsdp", "sequence", "tensor"),
        axis_types=(AxisType.Auto,) * 3,
        devices=jax.devices()[: 4 * sequence],
    )
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.standard_normal((VOCAB, EMBED)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (4, 256)), jnp.int32)  # more than the rows: XLA gathers the table
    weights = jnp.asarray(rng.standard_normal((4, 256, EMBED)), jnp.float32)
    program, value, grad = lookup_and_gradient(mesh, rules, table, tokens, weights)
    want_value, want_grad = jax.value_and_grad(lambda t: jnp.sum(jnp.take(t, tokens, axis=0) * weights))(table)
    # A token's rows are summed per device first: the sums' order is the partitioner's, so fp32 rounding differs.
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-5, atol=1e-5)
    assert float(value) == pytest.approx(float(want_value), rel=1e-6)
    if vocab_parallel:  # no device holds the whole table, nor its whole gradient
        assert f"f32[{VOCAB},{EMBED}]" not in program
