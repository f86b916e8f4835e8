"""model.fp8=tensorwise (projection.py): the error of a scaled fp8 matmul and its gradients, bounded by the
formats' precision; bad values refused; the CUDA-lowered step's projections take fp8 operands, nothing else does."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax.config import load_config
from llama_jax.errors import ConfigError
from llama_jax.model.llama import fp8_input
from llama_jax.model.projection import FP8_FORWARD, FP8_GRADIENT, fp8_project
from llama_jax.training.step import lower_step


def _element_error(dtype, values):
    """Per element: half an ulp relative (2^-(mantissa bits + 1)) plus half the smallest subnormal, scaled."""
    info = jnp.finfo(dtype)
    scale = np.abs(values).max() / float(info.max)
    return 2.0 ** -(info.nmant + 1) * np.abs(values) + 0.5 * float(info.smallest_subnormal) * scale


def test_scaled_matmul_and_its_gradients_are_within_the_formats_rounding():
    x = np.asarray(jax.random.normal(jax.random.key(0), (4, 16, 64)), np.float32)
    w = np.asarray(jax.random.normal(jax.random.key(1), (64, 32)) * 0.02, np.float32)
    dy = np.asarray(jax.random.normal(jax.random.key(2), (4, 16, 32)) * 1e-3, np.float32)
    y, vjp = jax.vjp(lambda a, b: fp8_project("btd,df->btf", a, b), x, w)
    dx, dw = vjp(dy)
    ex, ew, edy = _element_error(FP8_FORWARD, x), _element_error(FP8_FORWARD, w), _element_error(FP8_GRADIENT, dy)

    def bound(a, ea, b, eb, spec):  # |a b - a' b'| <= |ea| |b| + |a| |eb| + |ea| |eb|, plus fp32 accumulation
        exact = np.einsum(spec, np.abs(a), np.abs(b))
        return np.einsum(spec, ea, np.abs(b)) + np.einsum(spec, np.abs(a), eb) + np.einsum(spec, ea, eb) + 1e-6 * exact

    assert np.all(np.abs(y - np.einsum("btd,df->btf", x, w)) <= bound(x, ex, w, ew, "btd,df->btf"))
    assert np.all(np.abs(dx - np.einsum("btf,df->btd", dy, w)) <= bound(dy, edy, w, ew, "btf,df->btd"))
    assert np.all(np.abs(dw - np.einsum("btd,btf->df", x, dy)) <= bound(x, ex, dy, edy, "btd,btf->df"))
    # and the error is real: fp8 is not silently fp32
    assert np.abs(y - np.einsum("btd,df->btf", x, w)).max() > 0


def test_a_bad_fp8_value_is_one_line():
    with pytest.raises(ConfigError, match="model.fp8 must be one of none, tensorwise, got 'e4m3'"):
        load_config("tiny", ["model.fp8=e4m3"])


def test_cuda_step_feeds_every_projection_fp8_and_nothing_else():
    """7 projections per layer: 7 forward dots of e4m3 x e4m3 and 14 backward ones with the e5m2 gradient; the
    attention scores, the output projection and the loss stay in the compute dtype."""
    config = load_config("tiny", ["model.fp8=tensorwise", "train.batch_size=2", "mesh.fsdp=1"])
    text = lower_step(config, "cuda", devices=jax.devices()[:1]).as_text()
    dots = re.findall(r"stablehlo.dot_general.*: \((tensor<[^>]+>), (tensor<[^>]+>)\)", text)
    fp8 = [d for d in dots if "f8E4M3FN" in d[0] + d[1]]
    forward = [d for d in fp8 if "f8E5M2" not in d[0] + d[1]]
    assert len(forward) >= 7 and len(fp8) - len(forward) >= 14  # (forward dots may be traced twice: recomputed)
    others = [d for d in dots if d not in fp8]
    assert others and not any("f8" in a + b for a, b in others)  # attention and the output projection


def test_fp8_operands_saved_by_a_remat_policy_keep_the_step_finite():
    """A policy that saves the fp8 copies of a projection input by name (save_dot_except_mlp saves
    attention_context) gave a NaN loss on XLA:CPU when the float8 array itself was named; its raw bytes are."""
    cfg = load_config("tiny", ["model.fp8=tensorwise", "model.compute_dtype=bfloat16"]).model
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    x, w = jax.random.normal(k1, (2, 16, 64)), jax.random.normal(k2, (64, 96)) * 0.02

    def loss(x, w):
        y = fp8_project("btd,df->btf", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), fp8_input(cfg, x, "saved"))
        return jnp.sum(jnp.tanh(y.astype(jnp.float32)) ** 2)

    saving = jax.checkpoint(loss, policy=jax.checkpoint_policies.save_only_these_names("saved"))
    value, grads = jax.jit(jax.value_and_grad(saving, (0, 1)))(x, w)
    assert jnp.isfinite(value) and all(bool(jnp.isfinite(g).all()) for g in grads)
    assert value == jax.jit(loss)(x, w)
