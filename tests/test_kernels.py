"""The CPU fast path: blocked (flash) attention and the projection's CPU backward pass, each checked
against the plain XLA computation it replaces, forward and gradients, at fixed fp32 tolerances."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax import flash, projection
from llama_jax.attention import document_mask, skips_masked_blocks
from llama_jax.config import load_config
from llama_jax.model import train_flops_per_token


def reference_attention(q, k, v, segments):
    mask = None if segments is None else document_mask(segments, segments)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")


@pytest.mark.parametrize("seq, heads, kv_heads, documents", [
    (256, 4, 2, False),  # GQA, two blocks
    (512, 4, 4, True),  # multi-head, packed documents crossing block edges
    (1024, 8, 2, True),  # four query heads per kv head
])
def test_blocked_attention_matches_xla_forward_and_gradients(seq, heads, kv_heads, documents):
    rng = np.random.default_rng(seq)
    batch, head_dim = 2, 16
    q = jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, seq, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((batch, seq, kv_heads, head_dim)), jnp.float32)
    segments = None
    if documents:
        ids = np.ones((batch, seq), np.int32)
        ids[0, 100:] = 2
        ids[0, seq // 2 + 7:] = 3
        ids[1, 129:] = 2
        segments = jnp.asarray(ids)
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, segments) * weights)

    np.testing.assert_allclose(flash.blocked_attention(q, k, v, segments), reference_attention(q, k, v, segments),
                               atol=1e-5)
    expected = jax.grad(loss(reference_attention), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(loss(flash.blocked_attention), argnums=(0, 1, 2))(q, k, v)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-5)


def test_block_sizes():
    assert flash.block_size(128) is None  # a single block: nothing to skip
    assert flash.block_size(512) == 128
    assert flash.block_size(4096) == 512  # at most 8 blocks
    assert flash.block_size(8192) == 1024
    assert flash.block_size(1000) is None


@pytest.mark.parametrize("spec, x_shape, kernel_shape", [
    ("btd,dnh->btnh", (2, 8, 16), (16, 4, 8)),
    ("btnh,nhd->btd", (2, 8, 4, 8), (4, 8, 16)),
    ("btd,df->btf", (2, 8, 16), (16, 48)),
])
def test_cpu_projection_equals_einsum_forward_and_gradients(spec, x_shape, kernel_shape):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal(kernel_shape), jnp.float32)
    assert jax.default_backend() == "cpu" and projection.uses_cpu_backward("cpu")
    np.testing.assert_allclose(projection.project(spec, x, kernel), jnp.einsum(spec, x, kernel), rtol=1e-6, atol=1e-6)
    ours = jax.grad(lambda x, w: jnp.sum(jnp.sin(projection.project(spec, x, w))), argnums=(0, 1))(x, kernel)
    plain = jax.grad(lambda x, w: jnp.sum(jnp.sin(jnp.einsum(spec, x, w))), argnums=(0, 1))(x, kernel)
    for a, b in zip(ours, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_projection_backward_is_chosen_per_platform():
    assert projection.uses_cpu_backward("cpu")
    assert not projection.uses_cpu_backward("gpu") and not projection.uses_cpu_backward("tpu")


def test_kernels_that_skip_the_masked_half_count_half_the_attention_flops():
    cfg = load_config("bench").model
    full, half = train_flops_per_token(cfg, 512), train_flops_per_token(cfg, 512, causal_skip=True)
    assert full - half == pytest.approx(6 * cfg.n_layers * cfg.n_heads * cfg.resolved_head_dim * 512)
    assert skips_masked_blocks("blocked") and skips_masked_blocks("cudnn") and not skips_masked_blocks("xla")
