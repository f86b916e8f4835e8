"""Which layers each pipeline stage holds, and the order the layer stack is stored in.

With mesh.pipeline = P stages and mesh.pipeline_repeats = R, the L layers form P·R groups of consecutive
layers, and group g runs on stage g mod P: each device holds R groups that are P groups apart (R = 1: one
group per stage). The groups hold L/(P·R) layers each, or as many as mesh.pipeline_stage_layers says (uneven
stages: Llama 3 405B's 126 layers over 16 stages, the first and the last lighter, as they also hold the
embedding and the loss).

The layer leaves of the params (and of the optimizer moments that mirror them) have a leading `layers` axis,
sharded over the pipeline axis, in *storage order*: device p's contiguous block holds its R groups (p, P + p,
2P + p, ...), each in `slots` = max(layers of a group) places; a group with fewer layers leaves its last
places empty (zeros that never run, get no gradient and stay zero). Even stages without repeats store the
natural order. Checkpoints record the order (their config's mesh), and reading one into another
(`relayout`) moves the layers, and may change the leading axis's length, so a run saved with one pipeline
layout resumes with any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from llama_jax.config import MeshConfig


@dataclass(frozen=True)
class LayerOrder:
    """How the layer stack is stored: the pipeline's stages, repeats and the layers of each group (group g =
    r·P + p: repeat r of stage p; () = as many in each)."""

    stages: int = 1
    repeats: int = 1
    group_layers: tuple[int, ...] = ()

    @classmethod
    def of(cls, mesh: MeshConfig, stages: int) -> LayerOrder:
        """The order of a run with these mesh settings on `stages` pipeline stages (mesh.pipeline resolved)."""
        return cls(stages, mesh.pipeline_repeats, tuple(mesh.pipeline_stage_layers))

    def __post_init__(self):
        if len(set(self.group_layers)) == 1:  # even after all: stored like the even layout
            object.__setattr__(self, "group_layers", ())
        if self.stages == 1:
            object.__setattr__(self, "repeats", 1)  # one stage runs its groups in the natural order

    def groups(self, n_layers: int) -> tuple[int, ...]:
        """The layers of each group, g = r·P + p."""
        count = self.stages * self.repeats
        return self.group_layers or (n_layers // count,) * count

    def slots(self, n_layers: int) -> int:
        """Places per group in storage: the layers of the largest group."""
        return max(self.groups(n_layers))

    def length(self, n_layers: int) -> int:
        """The leading axis of a stored layer leaf."""
        return self.stages * self.repeats * self.slots(n_layers)

    def stored_layers(self, n_layers: int) -> np.ndarray:
        """[length] the natural layer index at each stored place, -1 where a place is empty."""
        groups = self.groups(n_layers)
        first = np.concatenate([[0], np.cumsum(groups)[:-1]])
        slots = self.slots(n_layers)
        out = np.full((self.stages, self.repeats, slots), -1)
        for p in range(self.stages):
            for r in range(self.repeats):
                g = r * self.stages + p
                out[p, r, : groups[g]] = first[g] + np.arange(groups[g])
        return out.reshape(-1)

    def stage_layers(self, n_layers: int) -> np.ndarray:
        """[stages, repeats] the layers each stage runs in each repeat."""
        return np.asarray(self.groups(n_layers)).reshape(self.repeats, self.stages).T

    def natural_layers(self, length: int) -> int:
        """L, from the leading axis of a leaf stored in this order."""
        return sum(self.group_layers) if self.group_layers else length


NATURAL = LayerOrder()


def to_storage_order(layers_tree, order: LayerOrder):
    """Layer leaves [L, ...] in natural order -> `order`'s storage (empty places zero)."""
    return relayout(layers_tree, NATURAL, order, jit=False)


def to_natural_order(layers_tree, order: LayerOrder):
    """The inverse of to_storage_order."""
    return relayout(layers_tree, order, NATURAL, jit=False)


def relayout(tree, saved: LayerOrder, wanted: LayerOrder, target=None, jit: bool = True):
    """A state or params read in the storage order `saved`, in the storage order `wanted`. Each layer leaf is
    moved on its devices, into the sharding of `target`'s leaf (a tree like `tree` of ShapeDtypeStructs or
    arrays), or else its own (the leading axis unsplit where its new length does not divide)."""

    def move(x, like):
        n_layers = saved.natural_layers(x.shape[0])
        source, dest = saved.stored_layers(n_layers), wanted.stored_layers(n_layers)
        if np.array_equal(source, dest):
            return x
        place = np.zeros(n_layers, np.int32)
        place[source[source >= 0]] = np.nonzero(source >= 0)[0]  # natural layer -> its place in x
        take = place[np.maximum(dest, 0)]
        filled = (dest >= 0).reshape(-1, *(1,) * (x.ndim - 1))

        def reorder(x):
            moved = jnp.take(x, take, axis=0)
            return moved if filled.all() else jnp.where(filled, moved, jnp.zeros((), x.dtype))

        if not jit:
            return reorder(x)
        sharding = getattr(like, "sharding", None) or _resized(x.sharding, (len(dest), *x.shape[1:]))
        return jax.jit(reorder, out_shardings=sharding)(x)

    return _map_layer_leaves(move, tree, target)


def in_order(abstract_tree, wanted: LayerOrder, saved: LayerOrder):
    """`abstract_tree` (ShapeDtypeStructs of a state or params stored in order `wanted`) as stored in order
    `saved`: the target to read a checkpoint saved in that order, before relayout(..., saved, wanted)."""

    def resize(a, _):
        length = saved.length(wanted.natural_layers(a.shape[0]))
        shape = (length, *a.shape[1:])
        return jax.ShapeDtypeStruct(shape, a.dtype, sharding=_resized(a.sharding, shape))

    return _map_layer_leaves(resize, abstract_tree, None)


def _resized(sharding, shape):
    """`sharding` for an array of `shape`: the leading axis unsplit where the mesh axes do not divide it."""
    if not isinstance(sharding, NamedSharding) or not sharding.spec:
        return sharding
    first = sharding.spec[0]
    axes = () if first is None else (first,) if isinstance(first, str) else tuple(first)
    if shape[0] % int(np.prod([sharding.mesh.shape[a] for a in axes])) == 0:
        return sharding
    return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec[1:]))


def _map_layer_leaves(fn, tree, others):
    """fn(leaf, other) for every leaf under a "layers" key (params and the optimizer moments that mirror them),
    `other` the leaf at the same place of `others` (None if None)."""

    def visit(path, leaf, *other):
        in_layers = any(isinstance(key, jax.tree_util.DictKey) and key.key == "layers" for key in path)
        return fn(leaf, other[0] if other else None) if in_layers and getattr(leaf, "ndim", 0) > 0 else leaf

    if others is None:
        return jax.tree_util.tree_map_with_path(visit, tree)
    return jax.tree_util.tree_map_with_path(visit, tree, others)
