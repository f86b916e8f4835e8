"""The device mesh and THE table that maps logical axis names onto it.

The model names every axis logically (``embed``, ``heads``, ``batch``, ...). ``LOGICAL_AXIS_RULES``
is the only place that says which mesh axis each name is split over; parameters, optimizer state,
batches and activation constraints all derive their shardings from it.

Mesh axes, outermost (slowest links) to innermost (fastest):
    pipeline  pipeline stages (pipeline.py): the layers split, micro-batches handed from stage to stage
    data      plain data parallelism: params replicated, batch split
    fsdp      data parallelism with params, grads and optimizer state split (gathered per layer)
    sequence  context parallelism: the sequence split across devices
    tensor    Megatron tensor parallelism: heads and MLP hidden split
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from llama_jax.config import Config, MeshConfig
from llama_jax.config.checks import parse_axes
from llama_jax.config.choices import MESH_AXES
from llama_jax.errors import ConfigError
from llama_jax.model.context import logical_to_mesh_axes, rule_axes
from llama_jax.model.context_parallel import chunk_order
from llama_jax.model.llama import abstract_params
from llama_jax.model.params import is_param
from llama_jax.model.pipeline import fewest_microbatches, pass_microbatches
from llama_jax.model.stages import LayerOrder

# logical axis (config/choices.py) -> mesh axis (or axes, or None = replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("layers", "pipeline"),  # each stage holds its layers (pipeline.py: in storage order)
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    # adapters (peft.*): small, so their own axes are never split; their model axes (embed, heads, ...)
    # follow the rows above, so each adapter is sharded like the projection it adapts
    ("lora_rank", None),
    ("virtual_tokens", None),
    ("prompt_hidden", None),
    # activations
    # Pipelining splits the batch over the stages too, for the loss (inside a stage the axis is manual).
    ("batch", ("data", "fsdp", "pipeline")),
    ("seq", "sequence"),
    ("residual_seq", "sequence"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


def axis_rules(config: Config) -> tuple:
    """The table for this run: LOGICAL_AXIS_RULES, with Megatron sequence parallelism (which also
    splits the residual stream's sequence over `tensor`, so norms and residual adds hold 1/tensor
    of the activations) and then the expert overrides of `mesh.rules` applied."""
    rules = dict(LOGICAL_AXIS_RULES)
    if config.mesh.sequence_parallel and config.mesh.tensor > 1:
        rules["residual_seq"] = ("sequence", "tensor")
    if config.model.n_kv_heads % max(config.mesh.tensor, 1):
        # Fewer kv heads than tensor shards (e.g. Llama 3's 8 kv heads at tensor=16): every shard
        # keeps all key/value heads, as Megatron does, while the query heads stay split.
        rules["kv_heads"] = rules["act_kv_heads"] = None
    for logical, value in config.mesh.rules.items():
        rules[logical] = parse_axes(value)
    return tuple(rules.items())


def mesh_shape(mesh: MeshConfig, n_devices: int) -> dict[str, int]:
    """Resolve -1 and check the product against the device count."""
    sizes = {
        "pipeline": mesh.pipeline,
        "data": mesh.data,
        "fsdp": mesh.fsdp,
        "sequence": mesh.sequence,
        "tensor": mesh.tensor,
    }
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
            "make the product of mesh.pipeline, mesh.data, mesh.fsdp, mesh.sequence and mesh.tensor equal the device "
            "count (or set one of them to -1)"
        )
    return sizes


def _describe(sizes: dict[str, int]) -> str:
    return "×".join(f"{k}={v}" for k, v in sizes.items())


def check_divisibility(config: Config, sizes: dict[str, int]) -> None:
    """Errors that depend on both the model/batch and the mesh."""
    m, t = config.model, config.train
    batch_shards = sizes["data"] * sizes["fsdp"]
    stages, repeats = sizes["pipeline"], config.mesh.pipeline_repeats
    # auto picks a count that divides, at least the fewest (a multiple of the stages when pipelining)
    microbatches = fewest_microbatches(config.mesh, stages) if t.microbatches == "auto" else t.microbatches
    if t.batch_size % (batch_shards * microbatches):
        raise ConfigError(
            f"train.batch_size ({t.batch_size}) must be divisible by data×fsdp×microbatches "
            f"({sizes['data']}×{sizes['fsdp']}×{microbatches} = {batch_shards * microbatches})"
        )
    uneven = config.mesh.pipeline_stage_layers  # checked against the stages in config/checks.py
    if not uneven and m.n_layers % (stages * repeats):
        raise ConfigError(
            f"model.n_layers ({m.n_layers}) must be divisible by mesh.pipeline × mesh.pipeline_repeats "
            f"({stages} × {repeats}): every stage runs the same number of layers per repeat, unless "
            "mesh.pipeline_stage_layers says how many each runs"
        )
    per_pass = pass_microbatches(config.mesh, microbatches)
    if stages > 1 and per_pass % stages:
        key = "mesh.pipeline_microbatches" if config.mesh.pipeline_microbatches else "train.microbatches"
        raise ConfigError(
            f"mesh.pipeline={stages} needs {key} to be a multiple of {stages} (at least one "
            f"micro-batch per stage; got {per_pass}); try {key}={2 * stages} (the "
            f"bubble is (P-1)/(M·R+P-1) of the step: more micro-batches, smaller bubble)"
        )
    if stages > 1 and microbatches % per_pass:
        raise ConfigError(
            f"train.microbatches ({microbatches}) must be a multiple of mesh.pipeline_microbatches "
            f"({per_pass}): the step accumulates the gradient over whole passes through the pipeline"
        )
    layers_per_group = m.n_layers // (stages * repeats)
    if stages > 1 and not uneven and layers_per_group % config.remat.every_n_layers:
        raise ConfigError(
            f"remat.every_n_layers ({config.remat.every_n_layers}) must divide the {layers_per_group} "
            "layers of each pipeline stage's group "
            "(model.n_layers / (mesh.pipeline × mesh.pipeline_repeats))"
        )
    tensor = sizes["tensor"]
    # Query heads split evenly over `tensor`; kv heads either split too or, when there are fewer
    # of them than shards, are replicated (which needs tensor to be a multiple of kv heads).
    ok = [d for d in range(1, m.n_heads + 1) if m.n_heads % d == 0 and (m.n_kv_heads % d == 0 or d % m.n_kv_heads == 0)]
    if tensor not in ok:
        raise ConfigError(
            f"model.n_heads ({m.n_heads}) and model.n_kv_heads ({m.n_kv_heads}) do not fit "
            f"mesh.tensor ({tensor}); tensor sizes that work: {ok}"
        )
    needs = {sizes["sequence"]: "mesh.sequence"}
    if config.mesh.sequence_parallel and sizes["tensor"] > 1:
        needs[sizes["sequence"] * sizes["tensor"]] = "mesh.sequence × mesh.tensor (sequence parallelism)"
    if config.mesh.load_balance and sizes["sequence"] > 1:
        needs[2 * sizes["sequence"]] = "2 × mesh.sequence (load-balanced context parallelism)"
    for divisor, reason in needs.items():
        if t.seq_len % divisor:
            raise ConfigError(
                f"train.seq_len ({t.seq_len}) must be divisible by {divisor} = {reason}; "
                f"try train.seq_len={t.seq_len // divisor * divisor or divisor}"
            )


# The config key behind each logical parameter axis, for error messages.
_AXIS_KEYS = {
    "vocab": "model.vocab_size",
    "embed": "model.d_model",
    "mlp": "model.ffn_dim",
    "heads": "model.n_heads",
    "kv_heads": "model.n_kv_heads",
    "head_dim": "model.head_dim",
}


def check_parameter_shapes(config: Config, sizes: dict[str, int]) -> None:
    """Every parameter dimension must split evenly over the mesh axes its logical name maps to."""
    rules = dict(axis_rules(config))
    leaves = jax.tree.leaves(abstract_params(config.model), is_leaf=is_param)
    # The layer stack as stored: padded to the largest stage's layers where stages are uneven (stages.py).
    stored = LayerOrder.of(config.mesh, sizes["pipeline"])
    for leaf in leaves:
        for dim, name in zip(leaf.shape, leaf.get_metadata()["out_sharding"]):
            dim = stored.length(dim) if name == "layers" else dim
            axes = rule_axes(rules.get(name))
            shards = math.prod(sizes[a] for a in axes)
            if dim % shards:
                fix = f"pad it to {-(-dim // shards) * shards}" if name == "vocab" else "change it"
                raise ConfigError(
                    f"{_AXIS_KEYS.get(name, name)} ({dim}) must be divisible by {'×'.join(axes)} "
                    f"({shards}) to shard the '{name}' axis; {fix} or choose another mesh"
                )


def split_over_hosts(shape: tuple[int, ...], n_hosts: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Split a mesh shape into (within-host, across-host) factors, outermost axes crossing hosts first.

    The outer axes (pipeline, data, then fsdp) carry the least traffic per step, so they take the slow
    links between hosts. None if the host count does not factor into the axes.
    """
    inner, outer, left = list(shape), [1] * len(shape), n_hosts
    for i in range(len(shape)):
        factor = math.gcd(inner[i], left)
        inner[i], outer[i], left = inner[i] // factor, factor, left // factor
    return (tuple(inner), tuple(outer)) if left == 1 else None


def make_mesh(config: Config, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    sizes = mesh_shape(config.mesh, len(devices))
    check_divisibility(config, sizes)
    check_parameter_shapes(config, sizes)
    shape = tuple(sizes[a] for a in MESH_AXES)
    # Auto axis types: the model's logical constraints are GSPMD hints, which Explicit axes reject
    # (docs/parallelism.md, "Explicit sharding").
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    n_hosts = len({d.process_index for d in devices})
    split = split_over_hosts(shape, n_hosts) if n_hosts > 1 else None
    if split is None:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    grid = mesh_utils.create_hybrid_device_mesh(split[0], split[1], devices, process_is_granule=True)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


@contextmanager
def activate(mesh: Mesh):
    """The mesh made current while tracing (jax.set_mesh): the model's logical activation constraints, which take
    their rules from its TraceContext, are placed on it."""
    with jax.set_mesh(mesh):
        yield


def logical_to_sharding(logical_tree, mesh: Mesh, rules: tuple):
    """A pytree whose nnx.Param leaves carry logical axis names (a state or params, abstract or not) ->
    NamedShardings by `rules` (other leaves, e.g. step counters: replicated)."""

    def placement(leaf):
        names = leaf.get_metadata().get("out_sharding") if is_param(leaf) else None
        return NamedSharding(mesh, PartitionSpec() if not names else logical_to_mesh_axes(tuple(names), rules))

    return jax.tree.map(placement, logical_tree, is_leaf=is_param)


def param_shardings(config: Config, mesh: Mesh):
    """The shardings of the model's parameters on `mesh` (a tree like the params)."""
    return logical_to_sharding(abstract_params(config.model), mesh, axis_rules(config))


def whole_matrices(spec: PartitionSpec, layers: int, mesh: Mesh) -> PartitionSpec:
    """Where Muon orthogonalizes a stack of `layers` matrices whose parameter is sharded as `spec`: as a
    [layers, rows, cols] array of whole matrices, the stack split over the mesh axes that split the parameter, as
    many as divide `layers` (the stack's own axes first: a pipeline stage keeps its layers), the matrices
    replicated over the axes left over. Newton-Schulz then needs no collective inside its iterations; moving the
    momentum there and the update back is an all-to-all (and an all-gather over the axes left over)."""
    own = rule_axes(spec[0]) if len(spec) else ()
    split = [axis for axis in own if mesh.shape[axis] > 1]
    for axis in (a for entry in spec[1:] for a in rule_axes(entry) if mesh.shape[a] > 1):
        if layers % (math.prod(mesh.shape[a] for a in split) * mesh.shape[axis]) == 0:
            split.append(axis)
    return PartitionSpec(tuple(split) or None, None, None)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches [batch, seq]: batch over data×fsdp, sequence over the context-parallel axis; every
    pipeline stage holds the rows (stage 0 embeds them, every stage computes a share of their loss)."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), "sequence"))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def balance_sequence(x: np.ndarray, shards: int) -> np.ndarray:
    """Reorder [batch, seq] so sequence shard i holds chunks i and 2·shards-1-i of the sequence.

    Under a causal mask late tokens attend to more keys than early ones; pairing an early chunk
    with a late one gives every shard the same amount of attention work. The model is indifferent
    to the order (positions and segment ids travel with the tokens) and the loss is a sum over tokens.
    """
    chunks = np.split(x, 2 * shards, axis=1)
    return np.concatenate([chunks[c] for c in chunk_order(shards, balanced=True)], axis=1)


def process_rows(mesh: Mesh, batch_size: int, seq_len: int) -> list[int]:
    """The rows of the global batch that this process's devices hold, in the order JAX lays them out.

    Each process loads only these rows; rows replicated over several local devices are loaded once.
    """
    indices = batch_sharding(mesh).addressable_devices_indices_map((batch_size, seq_len))
    return sorted({row for index in indices.values() for row in range(*index[0].indices(batch_size))})


def put_batch(
    batch: dict[str, np.ndarray], mesh: Mesh, batch_size: int, load_balance: bool = True
) -> dict[str, jax.Array]:
    """This process's rows (see process_rows) of a [batch, seq] batch -> global sharded arrays."""
    sharding = batch_sharding(mesh)
    shards = mesh.shape["sequence"]
    if load_balance and shards > 1:
        batch = {k: balance_sequence(v, shards) for k, v in batch.items()}
    return {k: jax.make_array_from_process_local_data(sharding, v, (batch_size, v.shape[1])) for k, v in batch.items()}
