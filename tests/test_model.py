"""Properties of the Llama model itself: causality, document isolation, GQA, RoPE, sizes."""

import dataclasses
import importlib.util
import inspect
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL, forward, tiny_config
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from test_train import random_batch

from llama_jax.config import load_config
from llama_jax.data.loader import model_inputs
from llama_jax.model import llama
from llama_jax.model.attention import select_implementation
from llama_jax.model.flops import train_flops_per_token
from llama_jax.model.llama import (
    HIDDEN,
    RESIDUAL,
    Block,
    abstract_model,
    abstract_params,
    child,
    init_params,
    param_count,
)
from llama_jax.model.params import param
from llama_jax.model.rope import apply_rope, rope_angles, rope_inverse_frequencies
from llama_jax.training.batches import put_batch
from llama_jax.training.program import TrainProgram

TOLERANCE = 1e-5  # fp32, absolute on logits of order 1
GOLDEN = Path(__file__).parent / "golden"


def init(cfg, seed=0):
    return init_params(cfg, jax.random.key(seed))


def logits_of(cfg, params, tokens, positions=None, segment_ids=None):
    return np.asarray(forward(abstract_model(cfg), params, jnp.asarray(tokens), positions, segment_ids))


@pytest.fixture(scope="module")
def params():
    return init(TINY_MODEL)


def test_changing_a_future_token_never_changes_earlier_logits(params):
    tokens = np.random.default_rng(0).integers(0, TINY_MODEL.vocab_size, (2, 24))
    changed = tokens.copy()
    changed[:, 15] = (changed[:, 15] + 7) % TINY_MODEL.vocab_size
    before, after = logits_of(TINY_MODEL, params, tokens), logits_of(TINY_MODEL, params, changed)
    np.testing.assert_array_equal(before[:, :15], after[:, :15])
    assert np.abs(before[:, 15:] - after[:, 15:]).max() > 1e-3  # and the change does reach later ones


def test_packed_documents_match_documents_alone(params):
    """Each document's logits are the same alone or packed behind/before others (built by model_inputs)."""
    rng = np.random.default_rng(1)
    bos = 1
    docs = [np.concatenate([[bos], rng.integers(3, TINY_MODEL.vocab_size, n)]) for n in (9, 13, 6)]
    docs.append(np.array([bos]))  # the next document's BOS, as a packed row ends
    packed = model_inputs(
        [
            {
                "tokens": np.concatenate(docs).astype(np.int32),
                "segment_ids": np.concatenate([np.full(len(d), i + 1, np.int32) for i, d in enumerate(docs)]),
                "positions": np.concatenate([np.arange(len(d), dtype=np.int32) for d in docs]),
            }
        ]
    )
    docs.pop()
    together = logits_of(TINY_MODEL, params, packed["tokens"], packed["positions"], packed["segment_ids"])
    offset = 0
    for doc in docs:
        alone = logits_of(TINY_MODEL, params, doc[None])
        np.testing.assert_allclose(together[0, offset : offset + len(doc)], alone[0], atol=TOLERANCE)
        offset += len(doc)


def test_grouped_query_attention_equals_multi_head_with_repeated_kv_weights(params):
    # Query head i reads kv head i // group (jax.nn.dot_product_attention's grouping), so repeating
    # each kv head's weights `group` times gives the equivalent multi-head model.
    group = TINY_MODEL.n_heads // TINY_MODEL.n_kv_heads
    mha_cfg = dataclasses.replace(TINY_MODEL, n_kv_heads=TINY_MODEL.n_heads)
    mha_params = jax.tree.map(lambda x: x, params)
    for name in ("k_proj", "v_proj"):
        kernel = params["layers"]["attn"][name]["kernel"]  # [layers, embed, kv_heads, head_dim]
        mha_params["layers"]["attn"][name] = {"kernel": jnp.repeat(kernel, group, axis=2)}
    tokens = np.random.default_rng(2).integers(0, TINY_MODEL.vocab_size, (2, 16))
    np.testing.assert_allclose(
        logits_of(TINY_MODEL, params, tokens), logits_of(mha_cfg, mha_params, tokens), atol=TOLERANCE
    )


@pytest.mark.parametrize("factor", [1.0, 8.0])
def test_rope_scores_depend_only_on_relative_position(factor):
    cfg = dataclasses.replace(TINY_MODEL, rope_scaling_factor=factor, rope_original_max_len=64)
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, cfg.resolved_head_dim)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, cfg.resolved_head_dim)), jnp.float32)

    def rotated(x, position):
        cos, sin = rope_angles(jnp.array([[position]]), cfg)
        return apply_rope(x, cos, sin)

    def score(m, n):
        return float(jnp.sum(rotated(q, m) * rotated(k, n)))

    for shift in (1, 17, 100):
        assert score(5, 2) == pytest.approx(score(5 + shift, 2 + shift), abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)


def reference_llama3_inverse_frequencies(head_dim, theta, factor, low, high, original):
    """Llama 3's published scaling, written out loop by loop as in Meta's reference code."""
    frequencies = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            frequencies.append(freq)
        elif wavelength > original / low:
            frequencies.append(freq / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            frequencies.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(frequencies)


def test_llama3_scaling_matches_the_reference_formula():
    cfg = dataclasses.replace(
        TINY_MODEL,
        d_model=512,
        n_heads=4,
        rope_theta=500000.0,
        rope_scaling_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_len=8192,
    )
    expected = reference_llama3_inverse_frequencies(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(rope_inverse_frequencies(cfg), expected, rtol=1e-6)


def test_llama3_scaling_keeps_high_frequencies_and_divides_low_ones():
    base = dataclasses.replace(TINY_MODEL, d_model=512, n_heads=4, rope_theta=500000.0)  # head_dim 128
    scaled = dataclasses.replace(
        base, rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=8192
    )
    plain, llama3 = rope_inverse_frequencies(base), rope_inverse_frequencies(scaled)
    wavelength = 2 * math.pi / plain
    high = wavelength < 8192 / 4.0
    low = wavelength > 8192 / 1.0
    assert high.any() and low.any() and (~high & ~low).any()
    np.testing.assert_allclose(llama3[high], plain[high], rtol=1e-6)
    np.testing.assert_allclose(llama3[low], plain[low] / 8.0, rtol=1e-6)
    middle = ~high & ~low  # smoothly in between
    assert np.all(llama3[middle] < plain[middle]) and np.all(llama3[middle] > plain[middle] / 8.0)


def test_tied_embeddings_have_no_output_projection():
    tied = dataclasses.replace(TINY_MODEL, tie_embeddings=True)
    assert "lm_head" not in init(tied)
    assert param_count(TINY_MODEL) - param_count(tied) == TINY_MODEL.d_model * TINY_MODEL.vocab_size


def test_explicit_head_dim_and_bfloat16_compute():
    cfg = dataclasses.replace(TINY_MODEL, head_dim=32, compute_dtype="bfloat16")  # heads*head_dim != d_model
    p = init(cfg)
    assert p["layers"]["attn"]["q_proj"]["kernel"].shape == (2, 64, 4, 32)
    assert p["layers"]["attn"]["q_proj"]["kernel"].dtype == jnp.float32  # fp32 master weights
    out = forward(abstract_model(cfg), p, jnp.zeros((1, 8), jnp.int32))
    assert out.dtype == jnp.bfloat16 and out.shape == (1, 8, TINY_MODEL.vocab_size)


def test_every_parameter_carries_logical_axis_names():
    boxed = jax.tree.leaves(abstract_params(TINY_MODEL), is_leaf=lambda x: isinstance(x, nnx.Param))
    specs = [p.get_metadata()["out_sharding"] for p in boxed]
    known = {"layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "norm"}
    assert specs and all(len(spec) > 0 and set(spec) <= known for spec in specs)


@pytest.mark.parametrize(
    "preset, published",
    [
        ("llama3_1b", 1.24e9),
        ("llama3_3b", 3.21e9),
        ("llama3_8b", 8.03e9),
        ("llama3_70b", 70.6e9),
        ("llama3_405b", 405.9e9),
    ],
)
def test_preset_parameter_counts_match_published_sizes(preset, published):
    count = param_count(load_config(preset).model)  # eval_shape: nothing is allocated
    assert abs(count - published) / published < 0.01


def test_train_flops_per_token_formula():
    cfg = load_config("llama3_8b").model
    # 6 * 8.03B params minus the embedding lookup (0.525B), plus attention 12*L*H*hd*T at T=8192
    expected = 6 * (8.030e9 - 128256 * 4096) + 12 * 32 * 32 * 128 * 8192
    assert train_flops_per_token(cfg, 8192) == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize(
    "requested, platform, dtype, head_dim, seq_len, expected",
    [
        ("auto", "gpu", jnp.bfloat16, 128, 4096, "cudnn"),
        ("auto", "gpu", jnp.float16, 64, 4096, "cudnn"),
        ("auto", "gpu", jnp.float32, 128, 4096, "blocked"),  # cuDNN flash attention needs 16-bit inputs
        ("auto", "gpu", jnp.bfloat16, 260, 4096, "blocked"),  # head_dim above cuDNN's 256 limit
        ("auto", "gpu", jnp.bfloat16, 60, 4096, "blocked"),  # not a multiple of 8
        ("auto", "gpu", jnp.float32, 128, 128, "xla"),  # too short to split into blocks
        ("auto", "cpu", jnp.float32, 64, 512, "blocked"),
        ("auto", "cpu", jnp.float32, 64, 1000, "xla"),  # no block length divides it
        ("auto", "cpu", jnp.bfloat16, 128, None, "blocked"),
        ("auto", "tpu", jnp.bfloat16, 128, 4096, "xla"),
        ("xla", "gpu", jnp.bfloat16, 128, 4096, "xla"),
        ("cudnn", "gpu", jnp.bfloat16, 128, 4096, "cudnn"),
        ("blocked", "gpu", jnp.bfloat16, 128, 4096, "blocked"),
    ],
)
def test_attention_implementation_selection(requested, platform, dtype, head_dim, seq_len, expected):
    assert select_implementation(requested, platform, dtype, head_dim, seq_len) == expected


def test_blocked_attention_where_it_cannot_run_is_an_error():
    with pytest.raises(ValueError, match="model.attention=auto"):
        select_implementation("blocked", "cpu", jnp.float32, 64, 100)
    with pytest.raises(ValueError, match="model.attention=auto"):
        select_implementation("blocked", "tpu", jnp.float32, 64, 512)


def test_requesting_cudnn_where_it_cannot_run_is_an_error():
    with pytest.raises(ValueError, match="model.attention=auto"):
        select_implementation("cudnn", "cpu", jnp.bfloat16, 128)


def test_a_fresh_model_draws_every_tensor_as_the_linen_model_did():
    """Each tensor of a freshly initialised llama3_1b-shaped model (2 layers), plain and with each kind of adapter,
    has the mean and standard deviation the Flax Linen model's had (tests/golden/init_stats.json, written at 464e997
    by tests/golden/make_init_stats.py), within sampling error: the same initializers at the same scales, though
    not the same draws (another key derivation). Two independent samples of n draws of spread sigma: their means
    differ by sigma·sqrt(2/n) and their standard deviations by sigma/sqrt(n) (normal draws; less for uniform ones)
    at one standard error; the bound is 6 of them. Constant tensors (norm scales 1, LoRA's B 0) exactly."""
    spec = importlib.util.spec_from_file_location("make_init_stats", GOLDEN / "make_init_stats.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    expected = json.loads((GOLDEN / "init_stats.json").read_text())
    cfg = maker.model_config()
    for case, settings in maker.CASES.items():
        got = maker.statistics(cfg, settings, seed=1, adapters_only=case != "plain")
        assert got and set(got) <= set(expected[case]), case
        for name, stats in got.items():
            want, sigma, n = expected[case][name], expected[case][name]["std"], stats["count"]
            assert n == want["count"], (case, name)
            assert abs(stats["mean"] - want["mean"]) <= 6 * sigma * math.sqrt(2 / n), (case, name)
            assert abs(stats["std"] - sigma) <= 6 * sigma / math.sqrt(n), (case, name, stats["std"], sigma)


# The example of docs/architecture.md ("Change the model"), word for word: a learned per-channel scale on each residual
# branch (LayerScale).
class ScaledBlock(Block):
    def __init__(self, cfg, peft, load_balanced, context, rngs):
        super().__init__(cfg, peft, load_balanced, context, rngs)
        self.attn_scale = param(rngs, nnx.initializers.constant(0.1), (cfg.d_model,), ("norm",), cfg.param_dtype)
        self.mlp_scale = param(rngs, nnx.initializers.constant(0.1), (cfg.d_model,), ("norm",), cfg.param_dtype)

    def __call__(self, x, inputs, dropout=None, cache=None):
        constrain = self.context.constrain
        h = constrain(checkpoint_name(self.attn_norm(x), "attn_norm"), HIDDEN)
        attended, cache = self.attn(h, inputs, child(dropout, "attn"), cache)
        x = constrain(x + self.attn_scale[...] * attended, RESIDUAL)
        h = constrain(checkpoint_name(self.mlp_norm(x), "mlp_norm"), HIDDEN)
        x = constrain(x + self.mlp_scale[...] * self.mlp(h, child(dropout, "mlp")), RESIDUAL)
        return x, cache


@pytest.mark.parametrize(
    "sections, devices",
    [
        (dict(mesh=dict(fsdp=2, tensor=2)), 4),  # the plain scan, sharded
        (dict(remat=dict(policy="full", every_n_layers=2)), 1),  # grouped remat
        (dict(mesh=dict(pipeline=2, fsdp=1), train=dict(microbatches=2)), 2),  # GPipe stages
    ],
    ids=["scan-fsdp2xtensor2", "grouped-remat", "gpipe"],
)
def test_the_change_the_model_example_trains_on_every_way(sections, devices, monkeypatch):
    """The sub-layer of docs/architecture.md's example, put in place of Block: its params are stacked per layer,
    sharded by their logical names, and learn, whichever way the stack runs; the guide shows this code."""
    guide = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    source = inspect.getsource(ScaledBlock)
    assert f"```python\n{source}```" in guide
    monkeypatch.setattr(llama, "Block", ScaledBlock)
    cfg = tiny_config(**sections)
    program = TrainProgram.for_config(cfg, jax.devices()[:devices])
    scale = program.state_shardings.params["layers"]["attn_scale"]
    assert program.state_shapes.params["layers"]["attn_scale"].shape == (2, cfg.model.d_model)
    assert scale.spec == jax.sharding.PartitionSpec("pipeline", None)  # layers -> pipeline, norm -> replicated
    batch = {k: np.asarray(v) for k, v in random_batch(cfg).items()}
    with program.activate():
        state = program.init_state(jax.random.key(0))
        for _ in range(2):
            state, metrics = program.train_step(state, put_batch(program, batch))
    assert np.isfinite(float(metrics["loss"]))
    learned = np.asarray(state.params["layers"]["attn_scale"])
    assert learned.shape == (2, cfg.model.d_model) and not np.allclose(learned, 0.1)
