"""The mesh and the logical-axis table: every mesh shape trains to the same numbers as one device."""

import dataclasses
import math

import jax
import numpy as np
import pytest
from conftest import TINY_MODEL, tiny_config
from jax.sharding import PartitionSpec as P
from test_train import random_batch

from llama_jax.config import load_config
from llama_jax.distributed import sharding
from llama_jax.errors import ConfigError
from llama_jax.training.batches import put_batch
from llama_jax.training.program import TrainProgram

# Eight query heads so that tensor=8 divides them; two kv heads (GQA), which tensor=8 replicates.
MESH_MODEL = dataclasses.replace(TINY_MODEL, n_heads=8, n_kv_heads=2)
MESH_MODEL_KV8 = dataclasses.replace(TINY_MODEL, n_heads=8, n_kv_heads=8)  # kv heads split over tensor=8
STEPS = 5

# (data, fsdp, tensor, sequence)
MESHES = [(8, 1, 1, 1), (1, 8, 1, 1), (1, 1, 8, 1), (1, 1, 1, 8), (2, 2, 2, 1), (1, 2, 2, 2), (2, 1, 2, 2)]
# The last mesh is the one before it with data in place of fsdp: only its default options (sequence parallelism,
# load-balanced order). The options' every combination is tried on 1x2x2x2, where the weights are sharded too.
DEFAULTS_ONLY = {(2, 1, 2, 2)}


def mesh_cases():
    for shape in MESHES:
        tensor, sequence, every = shape[2], shape[3], shape not in DEFAULTS_ONLY
        for sequence_parallel in [True, False] if tensor > 1 and every else [True]:
            for load_balance in [True, False] if sequence > 1 and every else [True]:
                name = (
                    "x".join(map(str, shape))
                    + ("" if tensor == 1 else "-sp" if sequence_parallel else "-nosp")
                    + ("" if sequence == 1 else "-balanced" if load_balance else "-inorder")
                )
                yield pytest.param(shape, sequence_parallel, load_balance, MESH_MODEL, id=name)
    yield pytest.param((1, 1, 8, 1), True, True, MESH_MODEL_KV8, id="1x1x8x1-sp-kv8")
    # kv heads (2) fewer than tensor shards (4) are replicated, also inside context parallelism.
    yield pytest.param((1, 1, 4, 2), True, True, MESH_MODEL, id="1x1x4x2-sp-balanced-kv-replicated")


def losses(cfg, devices, start=None):
    """The first STEPS losses of cfg's program on `devices`, from its init at key 0, or from start(program, state)."""
    program = TrainProgram.build(cfg, sharding.make_mesh(cfg, devices=devices))
    out = []
    with program.activate():
        state = program.init_state(jax.random.key(0))
        state = state if start is None else start(program, state)
        for step in range(STEPS):
            # Packed rows: three documents each, so document masks matter under context parallelism.
            batch = {k: np.asarray(v) for k, v in random_batch(cfg, seed=20 + step, documents_per_row=3).items()}
            state, metrics = program.train_step(state, put_batch(program, batch))
            out.append(float(metrics["loss"]))
    return np.array(out)


_reference_cache = {}


def single_device_losses(model):
    if model not in _reference_cache:
        _reference_cache[model] = losses(
            tiny_config(model=dataclasses.asdict(model), train=dict(lr=1e-2)), jax.devices()[:1]
        )
    return _reference_cache[model]


@pytest.mark.parametrize("shape, sequence_parallel, load_balance, model", list(mesh_cases()))
def test_mesh_matches_single_device(shape, sequence_parallel, load_balance, model):
    """First 5 losses (fp32) on an 8-device mesh equal the 1-device run within 1e-5 relative."""
    data, fsdp, tensor, sequence = shape
    cfg = tiny_config(
        model=dataclasses.asdict(model),
        train=dict(lr=1e-2),
        mesh=dict(
            data=data,
            fsdp=fsdp,
            tensor=tensor,
            sequence=sequence,
            sequence_parallel=sequence_parallel,
            load_balance=load_balance,
        ),
    )
    np.testing.assert_allclose(losses(cfg, jax.devices()), single_device_losses(model), rtol=1e-5)


def test_microbatches_on_a_mesh_match_single_device():
    """Gradient accumulation over 2 microbatches on fsdp×tensor×sequence gives the 1-device losses."""
    cfg = tiny_config(
        model=dataclasses.asdict(MESH_MODEL),
        train=dict(lr=1e-2, microbatches=2),
        mesh=dict(data=1, fsdp=2, tensor=2, sequence=2),
    )
    np.testing.assert_allclose(losses(cfg, jax.devices()), single_device_losses(MESH_MODEL), rtol=1e-5)


def test_the_table_maps_exactly_the_logical_axis_names_users_may_override():
    """choices.LOGICAL_AXES (what mesh.rules.<name> accepts) and the table name the same axes, in order."""
    from llama_jax.config.choices import LOGICAL_AXES

    assert tuple(name for name, _ in sharding.LOGICAL_AXIS_RULES) == LOGICAL_AXES


def test_parameter_shardings_follow_the_table():
    cfg = tiny_config(model=dataclasses.asdict(MESH_MODEL), mesh=dict(data=1, fsdp=4, tensor=2, sequence=1))
    params = TrainProgram.build(cfg, sharding.make_mesh(cfg)).state_shardings.params
    spec = lambda s: s.spec  # noqa: E731
    assert spec(params["embed"]["embedding"]) == P("tensor", "fsdp")  # [vocab, embed]
    assert spec(params["lm_head"]["kernel"]) == P("fsdp", "tensor")  # [embed, vocab]
    # the layers axis goes to the pipeline stages (here one)
    assert spec(params["layers"]["attn"]["q_proj"]["kernel"]) == P("pipeline", "fsdp", "tensor", None)
    assert spec(params["layers"]["attn"]["o_proj"]["kernel"]) == P("pipeline", "tensor", None, "fsdp")
    assert spec(params["layers"]["mlp"]["down_proj"]["kernel"]) == P("pipeline", "tensor", "fsdp")
    assert spec(params["layers"]["attn_norm"]["scale"]) == P("pipeline", None)


def test_expert_rule_override_moves_the_sharding():
    cfg = load_config("tiny", ["mesh.rules.embed=none", "mesh.rules.mlp=fsdp,tensor"])
    rules = dict(sharding.axis_rules(cfg))
    assert rules["embed"] is None and rules["mlp"] == ("fsdp", "tensor")
    with pytest.raises(ConfigError, match="unknown mesh axis 'tensr'"):
        load_config("tiny", ["mesh.rules.mlp=tensr"])
    with pytest.raises(ConfigError, match="unknown logical axis"):
        load_config("tiny", ["mesh.rules.mpl=tensor"])


def test_sequence_parallelism_splits_the_residual_stream_over_tensor():
    on = dict(sharding.axis_rules(load_config("tiny", ["mesh.tensor=2", "mesh.sequence_parallel=true"])))
    off = dict(sharding.axis_rules(load_config("tiny", ["mesh.tensor=2", "mesh.sequence_parallel=false"])))
    assert on["residual_seq"] == ("sequence", "tensor") and off["residual_seq"] == "sequence"


def per_device_bytes(tree, shardings):
    return sum(
        math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
        for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))
    )


def test_fsdp_state_per_device_is_an_eighth_of_the_total():
    """Params + Adam moments of the `bench` model under fsdp=8: at most 1.05 x total / 8 per device."""
    cfg = load_config("bench", ["mesh.fsdp=8"])
    program = TrainProgram.build(cfg, sharding.make_mesh(cfg))
    abstract = program.abstract_state()
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    assert per_device_bytes(abstract, program.state_shardings) <= 1.05 * total / 8


def test_balanced_layout_pairs_early_and_late_chunks():
    x = np.arange(16)[None]
    balanced = sharding.balance_sequence(x, shards=4)  # chunks of 2: shard i gets chunks i and 7 - i
    assert balanced[0].tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]


@pytest.mark.parametrize(
    "shape, hosts, expected",
    [
        ((8, 1, 1, 1), 2, ((4, 1, 1, 1), (2, 1, 1, 1))),
        ((2, 4, 1, 8), 4, ((1, 2, 1, 8), (2, 2, 1, 1))),  # data first, then fsdp, cross hosts
        ((1, 16, 1, 8), 16, ((1, 1, 1, 8), (1, 16, 1, 1))),
        ((1, 1, 1, 8), 3, None),
    ],
)
def test_outer_axes_cross_hosts(shape, hosts, expected):
    assert sharding.split_over_hosts(shape, hosts) == expected


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh.sequence=8", "train.seq_len=20"], "divisible by 8 = mesh.sequence"),
        (["mesh.sequence=4", "train.seq_len=36"], "divisible by 8 = 2 × mesh.sequence"),
        (["mesh.tensor=2", "mesh.sequence=2", "train.seq_len=31"], "divisible by 2 = mesh.sequence"),
        (
            ["mesh.tensor=2", "mesh.sequence=2", "train.seq_len=34", "mesh.load_balance=false"],
            "mesh.sequence × mesh.tensor",
        ),
    ],
)
def test_sequence_length_must_fit_the_sequence_sharding(overrides, message):
    cfg = load_config("tiny", overrides + ["mesh.fsdp=-1"])
    with pytest.raises(ConfigError, match=message):
        sharding.make_mesh(cfg)
