"""What a trace of the model is for, passed in one object: the platform, the mesh and the logical-axis rules.

The model picks kernels by platform (cuDNN attention on GPUs, the projections' CPU backward pass on CPUs, fp32
sums over pipeline stages on CPUs), decides by the mesh whether attention runs in a shard_map (context
parallelism, more tensor shards than kv heads) and how a pipeline splits its batch, and names its activations'
shardings through the logical-axis rules. All of it comes from a TraceContext, a field of the model chosen by
whoever builds it, never from what happens to be active while tracing:

    TrainProgram (training/step.py)  the mesh's platform (a compile-only GPU's, planned from a CPU: `--target`;
                                     lower_step's CUDA on this machine's CPUs), the mesh, sharding.axis_rules(config)
                                     and, for a GPU that is not here, what jax's cuDNN checks are told (`gpu`)
    Generator (inference/)           the params' mesh and the decoding table, or this process on its own
    TraceContext.local()             this process's platform, no mesh, no rules: decoding on one device, tests
                                     and code that call the model directly

A pipeline stage's body is traced in context.inside_stage(): the stage axis is manual there, so it leaves the
rules and joins manual_axes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial

import jax
from jax.sharding import Mesh, PartitionSpec

from llama_jax.model.pipeline import STAGE_AXIS, without_stage_axis


@dataclass(frozen=True)
class Gpu:
    """What jax's cuDNN checks ask of a GPU that is not here (jax_workarounds.py)."""

    compute_capability: str  # e.g. "9.0"
    cudnn_version: int  # as cuDNN reports it: 9.19.0 -> 91900


@dataclass(frozen=True)
class TraceContext:
    """The platform, mesh and logical-axis rules a trace is for. Frozen and hashable: a field of Flax modules."""

    platform: str  # 'cpu', 'gpu' or 'tpu': of the devices the step will run on, not always this process's
    mesh: Mesh | None = None  # None: one device, nothing sharded
    rules: tuple = ()  # the logical-axis table (sharding.axis_rules); (): no sharding constraints
    gpu: Gpu | None = None  # compiled for a GPU that is not here: what jax's cuDNN checks are told
    manual_axes: tuple[str, ...] = ()  # mesh axes a shard_map made manual here (a pipeline stage's)

    @classmethod
    def local(cls) -> TraceContext:
        """This process's platform, no mesh, no rules: the model run where it is called."""
        return cls(jax.default_backend())

    @classmethod
    def on_mesh(cls, mesh: Mesh, rules: tuple, platform: str | None = None, gpu: Gpu | None = None) -> TraceContext:
        """For `mesh` under `rules`; the platform is that of the mesh's devices unless given."""
        return cls(platform or mesh_platform(mesh), mesh, tuple(rules), gpu)

    @property
    def mesh_shape(self) -> dict[str, int]:
        """{mesh axis: devices along it}; {} without a mesh."""
        return {} if self.mesh is None else dict(self.mesh.shape)

    @property
    def shard_map_mesh(self) -> Mesh | None:
        """The mesh a shard_map of the model names: the trace's; inside a pipeline stage None, jax's own (the
        stage's shard_map has made its pipeline axis manual there)."""
        return None if self.manual_axes else self.mesh

    def axis_size(self, axes: str | tuple[str, ...] | None) -> int:
        """How many devices the mesh axes `axes` span (1 without a mesh, or for None)."""
        return math.prod(self.mesh_shape.get(a, 1) for a in rule_axes(axes))

    def mesh_axes(self, names: tuple[str | None, ...]) -> PartitionSpec:
        """The mesh axes of logical axis names, by the rules."""
        return logical_to_mesh_axes(names, self.rules)

    def constrain(self, x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
        """x sharded as its logical axis names say, by the rules (no-op without rules: a trace for one device)."""
        return with_logical_constraint(x, names, self.rules)

    def read(self, w: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
        """A parameter w (in the compute dtype) as a matmul or the embedding lookup reads it. Where the mesh splits
        the sequence (context parallelism), gathered over the mesh axes that split the batch and the sequence:
        FSDP's all-gather, made explicit, leaving the weight split over `tensor` only. XLA's partitioner, left to
        place it, moved activations instead: it cannot move tokens split over `sequence` to a weight split over
        `sequence` along `embed` (llama3_405b's mesh.rules.embed=fsdp,sequence), so it replicated them ("involuntary
        full rematerialization"); and with fsdp > 1 it gathered the tokens' sequence to keep the weight split,
        computing the projections on the whole sequence on every device (llama3_405b's 128K stage: twice the
        matmul FLOPs, and 170 TB of all-reduces per GPU and step). Without context parallelism the program is left
        as it was (the measured GPU steps and the 8K stages are planned that way). The gradient is reduce-scattered
        back to the weight's own sharding by XLA. (`gathered`'s explicit gradient sharding, tried here, made the
        partitioner replicate activations in the layers' backward pass: llama3_405b's 16K stage planned at 145 GiB
        and 2,053 s a step, against 64 GiB and 229 s.)"""
        rules = self._read_rules(names)
        return w if rules is None else with_logical_constraint(w, names, rules)

    def read_axes(self, names: tuple[str | None, ...]) -> PartitionSpec:
        """The mesh axes of a parameter as `read` returns it."""
        return logical_to_mesh_axes(names, self._read_rules(names) or self.rules)

    def gathered(self, w: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
        """w gathered over the mesh axes that split the batch and the sequence, whatever the mesh: FSDP's
        all-gather made explicit, for a weight that a loop reads many times (the loss's chunks), which XLA would
        otherwise gather again in every iteration. Its gradient goes straight to w's own sharding."""
        rules = self._gather_rules(names)
        return w if rules is None else _gather(w, names, rules, self.rules)

    def token_shards(self) -> tuple[int, int]:
        """How many devices split the activations' batch and their sequence: (batch, sequence)."""
        rules = dict(self.rules)
        return self.axis_size(rules.get("batch")), self.axis_size(rules.get("seq"))

    def _read_rules(self, names: tuple[str | None, ...]) -> tuple | None:
        """The rules `read` constrains a parameter with; None where it leaves the parameter as it is."""
        return self._gather_rules(names) if self.token_shards()[1] > 1 else None

    def _gather_rules(self, names: tuple[str | None, ...]) -> tuple | None:
        """The table less the axes splitting the batch and the sequence; None where that changes nothing."""
        rules = dict(self.rules)
        gathered = set(rule_axes(rules.get("seq"))) | set(rule_axes(rules.get("batch")))
        if not any(gathered & set(rule_axes(rules.get(name))) for name in names if name):
            return None
        for name in filter(None, names):
            rules[name] = tuple(a for a in rule_axes(rules.get(name)) if a not in gathered) or None
        return tuple(rules.items())

    def inside_stage(self) -> TraceContext:
        """The context of a pipeline stage's shard_map body: the stage axis is manual there, out of the rules."""
        return dataclasses.replace(
            self, rules=without_stage_axis(self.rules), manual_axes=(*self.manual_axes, STAGE_AXIS)
        )


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather(w, names, gathered_rules, own_rules):
    return with_logical_constraint(w, names, gathered_rules)


def _gather_forward(w, names, gathered_rules, own_rules):
    return _gather(w, names, gathered_rules, own_rules), None


def _gather_backward(names, gathered_rules, own_rules, _, g):
    # The plain constraint's transpose would gather the gradient too, only for the weight to keep its shard.
    return (with_logical_constraint(g, names, own_rules),)


_gather.defvjp(_gather_forward, _gather_backward)


def mesh_device(mesh: Mesh):
    """The device a mesh is described by: its first (a mesh holds devices of one kind): its platform chooses the
    step's kernels, its kind a compile-only GPU's target."""
    return mesh.devices.flat[0]


def mesh_platform(mesh: Mesh) -> str:
    """The platform of a mesh's devices ('cpu', 'gpu', 'tpu'): what the step's kernels are chosen for."""
    return mesh_device(mesh).platform


def logical_to_mesh_axes(names: tuple[str | None, ...], rules: tuple) -> PartitionSpec:
    """The mesh axes of an array whose axes have logical `names`, by `rules` ((logical name, mesh axes) pairs):
    in the rules' order, the first rule naming an axis decides it (None: not split), unless another of the
    array's axes already took one of its mesh axes; an axis no rule decides is not split. These are Flax Linen's
    semantics, which the table was written for (NNX has no function that takes the rules as an argument)."""
    named = [n for n in names if n is not None]
    if len(set(named)) != len(named):
        raise ValueError(f"a logical axis name appears twice in {names}: an array's axes are named once each")
    undecided = object()
    decided: list = [undecided if n is not None else None for n in names]
    for name, axes in rules:
        if name in names and decided[names.index(name)] is undecided:
            taken = {a for d in decided if d is not undecided for a in rule_axes(d)}
            if not taken & set(rule_axes(axes)):
                decided[names.index(name)] = axes
    return PartitionSpec(*(None if d is undecided else d for d in decided))


def with_logical_constraint(x: jax.Array, names: tuple[str | None, ...], rules: tuple) -> jax.Array:
    """x constrained to the sharding its logical axis names map to by `rules`; x itself without rules (a trace for
    one device). With rules the trace runs under its context's mesh (sharding.activate: jax.set_mesh), or a
    pipeline stage's shard_map of it, where the stage axis is manual."""
    return jax.lax.with_sharding_constraint(x, logical_to_mesh_axes(names, rules)) if rules else x


def rule_axes(rule: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """A rule's mesh axes as a tuple: None -> (), 'fsdp' -> ('fsdp',)."""
    return () if rule is None else (rule,) if isinstance(rule, str) else tuple(rule)
