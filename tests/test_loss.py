"""The fused, chunked cross-entropy and RMSNorm's backward pass: the same values and gradients as the
plain formulas (fp32, fixed tolerances), and what they keep for the backward pass."""

import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL, forward, tiny_config

from llama_jax.distributed import sharding
from llama_jax.model import loss
from llama_jax.model.llama import abstract_model, init_params
from llama_jax.model.norm import rms_norm
from llama_jax.perf import hlo
from llama_jax.training.program import TrainProgram

RELATIVE = 1e-6  # fp32


def relative_error(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("chunk_tokens", [4, 8, 1024])  # 8, 4 and 1 chunks of a 32-token row
def test_fused_loss_and_gradients_equal_the_plain_formula(chunk_tokens, monkeypatch):
    monkeypatch.setattr(loss, "CHUNK_TOKENS", chunk_tokens)
    rng = np.random.default_rng(0)
    batch, seq, embed, vocab = 2, 32, 16, 50
    x = jnp.asarray(rng.standard_normal((batch, seq, embed)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((embed, vocab)) * 0.3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (batch, seq)), jnp.int32)
    mask = jnp.asarray(rng.random((batch, seq)) > 0.2, jnp.float32)

    def plain(x, w):
        return loss.cross_entropy_sum(jnp.einsum("btd,dv->btv", x, w), targets, mask)[0]

    def fused(x, w):
        return loss.fused_cross_entropy_sum(x, w, targets, mask)[0]

    (want, want_grads), (got, got_grads) = (
        jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, weight) for f in (plain, fused)
    )
    assert abs(float(got - want)) / abs(float(want)) < RELATIVE
    for g, w in zip(got_grads, want_grads):
        assert relative_error(g, w) < RELATIVE
    # Scaled cotangents (the mean over tokens, a loss scale) scale the gradients.
    scaled = jax.grad(lambda x, w: 0.25 * fused(x, w))(x, weight)
    assert relative_error(scaled, 0.25 * got_grads[0]) < RELATIVE
    assert float(loss.fused_cross_entropy_sum(x, weight, targets, mask)[1]) == float(mask.sum())


@pytest.mark.parametrize("tied", [False, True])
def test_the_model_loss_equals_the_plain_formula_on_its_logits(tied, monkeypatch):
    monkeypatch.setattr(loss, "CHUNK_TOKENS", 8)
    cfg = dataclasses.replace(TINY_MODEL, tie_embeddings=tied)
    model = abstract_model(cfg)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
    targets = jnp.roll(tokens, -1, axis=1)
    mask = jnp.ones(tokens.shape, jnp.float32).at[:, -1].set(0)
    params = init_params(cfg, jax.random.key(0))

    def plain(p):
        return loss.cross_entropy_sum(forward(model, p, tokens), targets, mask)[0]

    def fused(p):
        return forward(model, p, tokens, targets=targets, loss_mask=mask)[0]

    (want, want_grads), (got, got_grads) = (jax.jit(jax.value_and_grad(f))(params) for f in (plain, fused))
    assert abs(float(got - want)) / abs(float(want)) < RELATIVE
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        assert relative_error(g, w) < 1e-5  # through every layer: fp32 sums in another order


def test_rms_norm_backward_equals_autodiff_of_the_formula():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 5, 16)), jnp.float32)
    scale = jnp.asarray(rng.standard_normal(16), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((3, 5, 16)), jnp.float32)

    def formula(x, scale):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * scale

    want = jax.grad(lambda x, s: jnp.sum(formula(x, s) * weights), argnums=(0, 1))(x, scale)
    got = jax.grad(lambda x, s: jnp.sum(rms_norm(x, s, 1e-5, jnp.dtype(jnp.float32)) * weights), argnums=(0, 1))(
        x, scale
    )
    for g, w in zip(got, want):
        assert relative_error(g, w) < RELATIVE


def test_the_backward_pass_keeps_no_logits_and_no_fp32_norm_copies():
    """bf16 compute: what the loss's backward keeps, read from jax's saved-residuals printer."""
    cfg = dataclasses.replace(TINY_MODEL, compute_dtype="bfloat16", n_layers=1)
    batch, seq = 2, 32
    model = abstract_model(cfg)
    tokens = jnp.zeros((batch, seq), jnp.int32)
    params = init_params(cfg, jax.random.key(0))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(lambda p: forward(model, p, tokens, targets=tokens)[0], params)
    saved = out.getvalue()
    assert f"{cfg.vocab_size}]" not in saved.replace(f"[{cfg.d_model},{cfg.vocab_size}]", "")  # only dW
    assert f"f32[{batch},{seq},{cfg.d_model}]" not in saved  # no fp32 copy of an activation


@pytest.mark.parametrize("data, fsdp, sequence", [(1, 8, 1), (2, 2, 2)])
def test_the_loss_loop_adds_no_communication_per_chunk(data, fsdp, sequence, monkeypatch):
    """Over an FSDP or data x fsdp x sequence mesh, the train step's collective traffic (compiled, per device) is
    the same with the loss over 4 chunks as over 1: the output weight is gathered once for the loop, and each
    device keeps its partial dW until after it. XLA, left to itself, gathered the weight and reduced dW in every
    chunk (35% more traffic at 4 chunks on fsdp=8)."""
    moved = []
    for chunk_tokens in (1024, 8):  # 1 and 4 chunks of a 32-token row
        monkeypatch.setattr(loss, "CHUNK_TOKENS", chunk_tokens)
        mesh = dict(data=data, fsdp=fsdp, tensor=1, sequence=sequence)
        cfg = tiny_config(train=dict(microbatches=2, batch_size=16), mesh=mesh)
        program = TrainProgram.build(cfg, sharding.make_mesh(cfg, devices=jax.devices()))
        collectives = hlo.analyze(program.compile_step().as_text(), jax.device_count()).collectives
        moved.append(sum(c.moved_bytes for c in collectives.values()))
    assert moved[1] == pytest.approx(moved[0], rel=1e-3)
