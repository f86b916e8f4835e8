"""model.fp8=tensorwise (projection.py): the error of a scaled fp8 matmul and its gradients, bounded by the
formats' precision; bad values refused; the CUDA-lowered step's projections take fp8 operands, nothing else does;
it composes with meshes and both pipeline schedules, LoRA, remat policies (which keep the fp8 bytes) and the guard.
Resuming bitwise: tests/test_train.py. Eval loss against bf16 over 300 steps: bench/fp8_loss.py."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL, tiny_config
from test_remat import residual_lines
from test_sharding import losses
from test_train import random_batch

from llama_jax.config import RematConfig, load_config
from llama_jax.distributed import sharding
from llama_jax.errors import ConfigError
from llama_jax.model.llama import fp8_input
from llama_jax.model.projection import FP8_FORWARD, FP8_GRADIENT, fp8_project
from llama_jax.training.step import TrainProgram, lower_step


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


# --- composition: meshes and schedules, LoRA, remat policies, the guard, resume -------------------------------------

FP8_MODEL = dataclasses.replace(TINY_MODEL, n_heads=8, n_kv_heads=2, n_layers=4, fp8="tensorwise")
MICROBATCHES = 4


def fp8_config(fp8="tensorwise", **sections):
    return tiny_config(model=dict(dataclasses.asdict(FP8_MODEL), fp8=fp8),
                       train=dict(lr=1e-2, microbatches=MICROBATCHES), **sections)


@pytest.fixture(scope="module")
def one_device():
    """The first losses on one device: fp8, and the same model with fp32 projections."""
    fp32 = fp8_config(fp8="none")
    return losses(fp8_config(), jax.devices()[:1]), losses(fp32, jax.devices()[:1])


@pytest.mark.parametrize("mesh", [
    dict(fsdp=2, tensor=2, sequence_parallel=True),
    dict(fsdp=2, sequence=2),
    dict(pipeline=2, fsdp=2),
    dict(pipeline=2, tensor=2, pipeline_schedule="1f1b", pipeline_stage_layers=[3, 1], rules={"batch": "data,fsdp"}),
], ids=["fsdp2xtensor2-sp", "fsdp2xsequence2", "gpipe-pipeline2xfsdp2", "1f1b-pipeline2xtensor2-uneven"])
def test_fp8_trains_to_one_devices_losses_on_every_mesh_and_schedule(mesh, one_device):
    """Scales are per tensor, not per shard (an amax over a sharded tensor is reduced over its shards), so a mesh
    quantizes as one device does: the first 3 losses (two updates in) agree within 1e-5 relative, as fp32 runs do.
    Later ones drift further, by design of fp8 rather than a fault: a sharded sum adds in another order, a 1e-7
    difference moves the odd element across an fp8 rounding boundary (a 1-in-16 step), and Adam's normalised update
    carries it into every weight. Over all 5 steps that drift stays well below fp8's own effect on the loss (against
    fp32 projections on one device).

    The 1F1B case keeps the batch off the pipeline axis: by default 1F1B makes each micro-batch of rows its stage
    already holds (nothing moves), other rows than gradient accumulation groups, and a scale is per micro-batch, so
    its fp8 numbers are those of another, equally valid grouping (docs/performance.md#fp8)."""
    fp8, fp32 = one_device
    devices = int(np.prod([v for k, v in mesh.items() if k in ("pipeline", "fsdp", "tensor", "sequence")]))
    got = losses(fp8_config(mesh=mesh), jax.devices()[:devices])
    np.testing.assert_allclose(got[:3], fp8[:3], rtol=1e-5)
    assert np.abs(got - fp8).max() < 0.25 * np.abs(fp8 - fp32).max(), (got, fp8, fp32)


def test_fp8_with_lora_trains_the_adapters_and_leaves_the_base_bitwise_unchanged():
    """The frozen base projections run in fp8 (the input gradient flows through their fp8 backward); the adapters'
    low-rank update stays in the compute dtype and learns."""
    cfg = tiny_config(model=dict(fp8="tensorwise"), peft=dict(method="lora", rank=2, targets=["q", "v", "down"]),
                      checkpoint=dict(init_from="x"), mesh=dict(fsdp=2), train=dict(lr=1e-2))
    program = TrainProgram.build(cfg, sharding.make_mesh(cfg, devices=jax.devices()[:2]))
    with program.activate():
        state = program.init_state(jax.random.key(0))
        base, adapters = (jax.tree.map(np.asarray, tree) for tree in (state.frozen, state.params))
        for step in range(3):
            batch = {k: np.asarray(v) for k, v in random_batch(cfg, seed=step).items()}
            state, metrics = program.train_step(state, program.put(batch))
            assert bool(metrics["finite"])
    for before, after in zip(jax.tree.leaves(base), jax.tree.leaves(state.frozen)):
        np.testing.assert_array_equal(np.asarray(after), before)
    changed = [not np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(state.params),
                                                                   jax.tree.leaves(adapters))]
    assert all(changed)


def fp8_saved(policy: RematConfig) -> list[tuple[str, str]]:
    """(tag, dtype[shape]) of what one fp8 layer keeps for its backward under `policy`."""
    cfg = dataclasses.replace(TINY_MODEL, fp8="tensorwise", compute_dtype="bfloat16")
    return [(m.group(2), m.group(1)) for line in residual_lines(policy, cfg=cfg)
            if (m := re.match(r"(\S+) named '(\w+)'", line))]


def test_a_policy_that_saves_a_projection_input_keeps_its_fp8_bytes_not_a_bf16_copy():
    """save_dot_except_mlp saves attention_context, the o projection's input: under fp8 what is kept is its e4m3
    bytes and their scale; a policy saving the norms' outputs likewise keeps q/k/v's and gate/up's fp8 operand."""
    saved = fp8_saved(RematConfig(policy="save_dot_except_mlp"))
    assert sorted(dtype for tag, dtype in saved if tag == "attention_context") == ["f32[]", "u8[2,16,4,16]"], saved
    saving_inputs = {tag: "save" for tag in ("attn_norm", "mlp_norm", "mlp_hidden")}
    inputs = fp8_saved(RematConfig(policy="full", custom=saving_inputs))
    assert sorted(inputs) == sorted([("attn_norm", "u8[2,16,64]"), ("attn_norm", "f32[]"), ("mlp_norm", "u8[2,16,64]"),
                                     ("mlp_norm", "f32[]"), ("mlp_hidden", "u8[2,16,128]"), ("mlp_hidden", "f32[]")])


def test_an_overflowing_fp8_step_is_skipped_by_the_guard():
    """An infinite weight makes its projection's scale infinite and the quantized values NaN (the clip that keeps
    rounding in range must not turn an overflow into a finite number): the step is non-finite and the guard skips
    its update, as in bf16."""
    cfg = tiny_config(model=dict(fp8="tensorwise"), mesh=dict(fsdp=1))
    program = TrainProgram.build(cfg, sharding.make_mesh(cfg, devices=jax.devices()[:1]))
    with program.activate():
        state = program.init_state(jax.random.key(0))
        poisoned = jax.tree.map(lambda p: p.at[(0,) * p.ndim].set(jnp.inf) if p.ndim == 3 else p, state.params)
        state, poisoned = state.replace(params=poisoned), jax.tree.map(np.asarray, poisoned)  # the step donates
        batch = {k: np.asarray(v) for k, v in random_batch(cfg, seed=0).items()}
        state, metrics = program.train_step(state, program.put(batch))
    assert not bool(metrics["finite"])
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(poisoned)):
        np.testing.assert_array_equal(np.asarray(a), b)  # the update was skipped
