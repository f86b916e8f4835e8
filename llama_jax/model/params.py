"""How the model's modules make their parameters: each an nnx.Param carrying its logical axis names.

The names (``embed``, ``heads``, ...) are metadata for sharding.py, which maps them onto a mesh from outside; a
parameter is made unsharded, wherever it is made (no mesh needed: Flax's eager sharding is off for each). The
layers' params are made once per layer and stacked along a leading ``layers`` axis, as the stack runs them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

LAYERS_AXIS = "layers"  # the logical name of the stacked layers' leading axis


def named(init: Callable, names: tuple[str | None, ...]) -> Callable:
    """An initializer whose parameter carries logical axis names (for Flax's own modules: nnx.Embed, ...)."""
    return nnx.with_partitioning(init, names, eager_sharding=False)


def param(rngs: nnx.Rngs, init: Callable, shape: tuple[int, ...], names: tuple[str | None, ...], dtype) -> nnx.Param:
    """A parameter of `shape` drawn by `init` from the rngs' params stream, named `names` (one per axis)."""
    return nnx.Param(init(rngs.params(), shape, jnp.dtype(dtype)), out_sharding=names, eager_sharding=False)


def stacked(make: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs) -> nnx.Module:
    """n modules made by `make`, each from its own keys, as one module whose params are stacked [n, ...] along a
    leading axis named `layers`."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS_AXIS})
    def make_all(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)

    return make_all(rngs)


def abstract(make: Callable[[], nnx.Module]) -> nnx.Module:
    """The module make() builds, with ShapeDtypeStructs for params: its graph and shapes, nothing computed. (Not
    nnx.eval_shape, which places the params on the current mesh by their names, as if they were mesh axes.)"""
    return nnx.merge(*jax.eval_shape(lambda: nnx.split(make())))


def is_param(x) -> bool:
    return isinstance(x, nnx.Variable)
