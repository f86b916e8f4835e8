"""The CPU fast path: blocked (flash) attention and the projection's CPU backward pass, each checked
against the plain XLA computation it replaces, forward and gradients, at fixed fp32 tolerances."""

import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL, forward
from flax import nnx

from llama_jax.config import PeftConfig, RematConfig, load_config
from llama_jax.model import flash, projection, remat
from llama_jax.model.attention import document_mask, skips_masked_blocks
from llama_jax.model.context import TraceContext
from llama_jax.model.cudnn import query_chunked_attention
from llama_jax.model.flops import train_flops_per_token
from llama_jax.model.llama import Block
from llama_jax.model.params import abstract
from llama_jax.model.rope import rope_angles
from llama_jax.model.stack import LayerInputs


def reference_attention(q, k, v, segments):
    mask = None if segments is None else document_mask(segments, segments)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")


@pytest.mark.parametrize(
    "seq, heads, kv_heads, documents",
    [
        (256, 4, 2, False),  # GQA, two blocks
        (512, 4, 4, True),  # multi-head, packed documents crossing block edges
        (1024, 8, 2, True),  # four query heads per kv head
    ],
)
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
        ids[0, seq // 2 + 7 :] = 3
        ids[1, 129:] = 2
        segments = jnp.asarray(ids)
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, segments) * weights)

    np.testing.assert_allclose(
        flash.blocked_attention(q, k, v, segments), reference_attention(q, k, v, segments), atol=1e-5
    )
    expected = jax.grad(loss(reference_attention), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(loss(flash.blocked_attention), argnums=(0, 1, 2))(q, k, v)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("chunk", [128, 1024])  # several chunks; one chunk of the whole sequence
def test_query_chunked_attention_matches_xla_forward_and_gradients(chunk):
    """cuDNN's fallback for rows with more documents than its packed layout holds."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 512, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 512, 2, 16)), jnp.float32) for _ in range(2))
    ids = np.ones((2, 512), np.int32)
    ids[0, 100:], ids[0, 300:], ids[1, 129:] = 2, 3, 2
    segments, weights = jnp.asarray(ids), jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    fallback = lambda q, k, v, s: query_chunked_attention(q, k, v, s, chunk)  # noqa: E731
    np.testing.assert_allclose(fallback(q, k, v, segments), reference_attention(q, k, v, segments), atol=1e-5)
    for fn_grads in zip(
        *(
            jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v, segments) * weights), argnums=(0, 1, 2))(q, k, v)
            for f in (fallback, reference_attention)
        )
    ):
        np.testing.assert_allclose(fn_grads[0], fn_grads[1], atol=1e-4, rtol=1e-5)


def test_block_sizes():
    assert flash.block_size(128) is None  # shorter than MIN_SEQ: XLA's attention
    assert flash.block_size(512) == 64
    assert flash.block_size(4096) == 512  # at most 8 blocks
    assert flash.block_size(8192) == 1024
    assert flash.block_size(1000) is None


@pytest.mark.parametrize(
    "spec, x_shape, kernel_shape",
    [
        ("btd,dnh->btnh", (2, 8, 16), (16, 4, 8)),
        ("btnh,nhd->btd", (2, 8, 4, 8), (4, 8, 16)),
        ("btd,df->btf", (2, 8, 16), (16, 48)),
        # x wider than dy: the backward pass moves dy instead (the MLP's down projection; then 2 output axes)
        ("btf,fd->btd", (2, 8, 48), (48, 16)),
        ("btd,dnh->btnh", (2, 8, 32), (32, 2, 4)),
    ],
)
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


def test_a_policy_that_keeps_attention_keeps_the_kernels_residuals_instead_of_rerunning_it():
    """save_dot_except_mlp keeps attention: the blocked kernel's per-query log-sum-exp is saved under the
    attention_context tag (with its inputs and output), so the backward pass never re-runs its forward."""
    cfg, batch, seq = dataclasses.replace(TINY_MODEL, max_seq_len=256), 2, 256
    x = jnp.ones((batch, seq, cfg.d_model))
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    segments = jnp.ones((batch, seq), jnp.int32)
    inputs = LayerInputs(*rope_angles(positions, cfg), segments, positions)

    def saved(policy: str) -> str:
        block = abstract(lambda: Block(cfg, PeftConfig(), True, TraceContext.local(), nnx.Rngs(0)))
        params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), nnx.to_pure_dict(nnx.state(block)))
        layer = jax.checkpoint(
            lambda p: forward(block, p, x, inputs)[0],
            policy=remat.checkpoint_policy(RematConfig(policy=policy)),
            prevent_cse=False,
        )
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(lambda p: layer(p).sum(), params)
        return out.getvalue()

    # One log-sum-exp per query: [batch, kv heads, tokens x the query heads sharing each kv head].
    lse = f"f32[{batch},{cfg.n_kv_heads},{seq * (cfg.n_heads // cfg.n_kv_heads)}] named 'attention_context'"
    assert lse in saved("save_dot_except_mlp")
    assert "attention_context" not in saved("full")
