"""Recomputation policies keep exactly the tensors they name (read from jax's saved-residuals printer)."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import pytest
from conftest import TINY_MODEL, forward
from flax import nnx

from llama_jax.config import PeftConfig, RematConfig, load_config
from llama_jax.config.choices import REMAT_POLICIES, REMAT_TAGS
from llama_jax.errors import ConfigError
from llama_jax.model import remat
from llama_jax.model.context import TraceContext
from llama_jax.model.llama import Block
from llama_jax.model.params import abstract
from llama_jax.model.rope import rope_angles
from llama_jax.model.stack import LayerInputs


def residual_lines(remat_config: RematConfig, peft: PeftConfig = PeftConfig(), cfg=TINY_MODEL) -> list[str]:
    """jax's saved-residuals printout of one layer of `cfg` (with `peft`'s adapters) under `remat_config`."""
    x = jnp.ones((2, 16, cfg.d_model))
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    segments = jnp.ones((2, 16), jnp.int32)
    inputs = LayerInputs(*rope_angles(positions, cfg), segments, positions)
    policy = remat.checkpoint_policy(remat_config)
    block = abstract(lambda: Block(cfg, peft, True, TraceContext.local(), nnx.Rngs(0)))
    # Shapes are all the printer needs: an eager init would compile op by op (seconds).
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), nnx.to_pure_dict(nnx.state(block)))

    def layer(params, x):
        return forward(block, params, x, inputs)[0]

    if policy is not None:  # as the stack runs a layer under a policy (stack/scan.py)
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)

    def loss(params, x):
        return layer(params, x).sum()

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(loss, params, x)
    return out.getvalue().splitlines()


def saved_residuals(
    remat_config: RematConfig, peft: PeftConfig = PeftConfig()
) -> tuple[dict[str, str], list[str], list[str]]:
    """What one layer (with `peft`'s adapters) keeps for its backward: {tag: shape} on the device, shapes
    offloaded to the host, and descriptions of any unnamed intermediate kept on the device."""
    lines = residual_lines(remat_config, peft)
    named = {m.group(2): m.group(1) for line in lines if (m := re.match(r"(\S+) named '(\w+)'", line))}
    host = sorted(line.split()[0].replace("<host>", "") for line in lines if "<host>" in line)
    unnamed = [
        line
        for line in lines
        if "named '" not in line
        and "<host>" not in line
        and "from the argument" not in line
        and "from a constant" not in line
    ]
    return named, host, unnamed


@pytest.fixture(scope="module")
def needed():
    """{tag: shape} of the tags the backward pass uses (keeping all tags keeps exactly these)."""
    named, _, _ = saved_residuals(RematConfig(policy="full", custom={tag: "save" for tag in REMAT_TAGS}))
    return named


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_each_policy_keeps_exactly_its_tags(policy, needed, monkeypatch):
    monkeypatch.setattr(remat, "host_offload_supported", lambda: True)  # CPU here has pinned host memory too
    named, host, unnamed = saved_residuals(RematConfig(policy=policy))
    chosen = remat.actions(RematConfig(policy=policy))
    assert set(named) == {t for t, a in chosen.items() if a == "save"} & set(needed)
    assert host == sorted(shape for t, shape in needed.items() if chosen[t] == "offload")
    assert unnamed == []  # nothing untagged (scores, softmax, rotary) is kept


def test_no_remat_keeps_untagged_intermediates_too():
    _, _, unnamed = saved_residuals(RematConfig(policy="none"))
    assert unnamed  # e.g. the rotated queries and keys and the attention probabilities


def test_custom_actions_refine_a_policy(needed, monkeypatch):
    monkeypatch.setattr(remat, "host_offload_supported", lambda: True)
    named, host, _ = saved_residuals(RematConfig(policy="full", custom={"mlp_hidden": "save", "key_proj": "offload"}))
    assert set(named) == {"mlp_hidden"} and host == [needed["key_proj"]]


def test_selective_keeps_the_projections_but_not_the_attention_core(needed):
    named, _, _ = saved_residuals(RematConfig(policy="selective"))
    assert {"query_proj", "key_proj", "value_proj", "attention_out", "mlp_gate", "mlp_up"} <= set(named)
    assert "attention_context" in needed and "attention_context" not in named


def test_cpu_memory_is_not_an_offload_target():
    assert jax.devices()[0].platform == "cpu" and not remat.host_offload_supported()


def test_offload_falls_back_to_saving_without_host_memory(monkeypatch):
    monkeypatch.setattr(remat, "host_offload_supported", lambda: False)
    config = RematConfig(policy="minimal_offload")
    assert "kept on the device instead" in remat.describe(config)
    named, host, _ = saved_residuals(config)
    assert "query_proj" in named and host == []


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["remat.policy=most"], "valid policies: none, full, selective"),
        (["remat.policy=full", "remat.custom.qproj=save"], "unknown tag; valid tags: attn_norm"),
        (["remat.policy=full", "remat.custom.query_proj=keep"], "must be one of save, offload, recompute"),
        (["remat.policy=none", "remat.custom.query_proj=save"], "set remat.policy to one of"),
        (["remat.policy=full", "remat.every_n_layers=3"], "positive divisor of model.n_layers"),
    ],
)
def test_bad_remat_config(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides)
