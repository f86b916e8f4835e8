"""The device mesh and THE table that maps logical axis names onto it.

The model names every axis logically (``embed``, ``heads``, ``batch``, ...). ``LOGICAL_AXIS_RULES``
is the only place that says which mesh axis each name is split over; parameters, optimizer state,
batches and activation constraints all derive their shardings from it.

Mesh axes, outermost (slowest links) to innermost (fastest):
    data      plain data parallelism: params replicated, batch split
    fsdp      data parallelism with params, grads and optimizer state split (gathered per layer)
    sequence  context parallelism: the sequence split across devices
    tensor    Megatron tensor parallelism: heads and MLP hidden split
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from llama_jax.config import Config, ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "sequence", "tensor")

# logical axis -> mesh axis (or axes, or None = replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    # activations
    ("batch", ("data", "fsdp")),
    ("seq", "sequence"),
    ("residual_seq", "sequence"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


def axis_rules(config: Config) -> tuple:
    """The rules for this run: Megatron sequence parallelism also splits the residual stream's
    sequence axis over `tensor`, so norms and residual adds hold 1/tensor of the activations."""
    if config.mesh.sequence_parallel and config.mesh.tensor > 1:
        return tuple(("residual_seq", ("sequence", "tensor")) if name == "residual_seq" else (name, axes)
                     for name, axes in LOGICAL_AXIS_RULES)
    return LOGICAL_AXIS_RULES


def mesh_shape(mesh: MeshConfig, n_devices: int) -> dict[str, int]:
    """Resolve -1 and check the product against the device count."""
    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "sequence": mesh.sequence, "tensor": mesh.tensor}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    fill = [k for k, v in sizes.items() if v == -1]
    if fill:
        if n_devices % fixed:
            raise ConfigError(
                f"mesh axes {_describe(sizes)} use {fixed} devices, which does not divide the {n_devices} "
                f"available, so mesh.{fill[0]}=-1 cannot fill the rest; choose sizes whose product divides {n_devices}"
            )
        sizes[fill[0]] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        raise ConfigError(
            f"mesh {_describe(sizes)} needs {math.prod(sizes.values())} devices but {n_devices} are available; "
            "make the product of mesh.data, mesh.fsdp, mesh.sequence and mesh.tensor equal the device count "
            "(or set one of them to -1)"
        )
    return sizes


def _describe(sizes: dict[str, int]) -> str:
    return "×".join(f"{k}={v}" for k, v in sizes.items())


def check_divisibility(config: Config, sizes: dict[str, int]) -> None:
    """Errors that depend on both the model/batch and the mesh."""
    m, t = config.model, config.train
    batch_shards = sizes["data"] * sizes["fsdp"]
    if t.batch_size % (batch_shards * t.microbatches):
        raise ConfigError(
            f"train.batch_size ({t.batch_size}) must be divisible by data×fsdp×microbatches "
            f"({sizes['data']}×{sizes['fsdp']}×{t.microbatches} = {batch_shards * t.microbatches})"
        )
    for key, heads in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads)):
        if heads % sizes["tensor"]:
            ok = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ConfigError(f"{key} ({heads}) is not divisible by mesh.tensor ({sizes['tensor']}); "
                              f"tensor sizes that work: {ok}")
    seq_shards = sizes["sequence"] * (sizes["tensor"] if config.mesh.sequence_parallel else 1)
    if t.seq_len % seq_shards:
        raise ConfigError(f"train.seq_len ({t.seq_len}) must be divisible by {seq_shards} "
                          "(mesh.sequence, times mesh.tensor with sequence parallelism)")


def make_mesh(config: Config, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    sizes = mesh_shape(config.mesh, len(devices))
    check_divisibility(config, sizes)
    shape = tuple(sizes[a] for a in MESH_AXES)
    # Auto axis types: Flax's logical constraints are GSPMD hints, which Explicit axes reject.
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


@contextmanager
def activate(mesh: Mesh, rules: tuple):
    """Make the mesh and rules visible to the model's logical activation constraints while tracing."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def logical_to_sharding(logical_tree, mesh: Mesh, rules: tuple):
    """A pytree of LogicallyPartitioned leaves (from eval_shape of init) -> NamedShardings."""
    specs = nn.get_partition_spec(logical_tree)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches [batch, seq]: batch over data×fsdp, sequence over the context-parallel axis."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), "sequence"))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Host batch (the full global batch on this single process) -> sharded device arrays."""
    sharding = batch_sharding(mesh)
    return {k: jax.device_put(v, sharding) for k, v in batch.items()}
