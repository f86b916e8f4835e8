"""LoRA's dropout keys: one per step, layer and adapted projection, derived from the step's key.

Training a peft run with peft.dropout, the train step gives the model one key per step (and micro-batch); the
layer stack gives each layer a key of its own, and each adapted projection folds its path into its layer's key
for its mask. The derivation is the one the model drew its masks with when it was written in Flax Linen (until
2026-12), so that a LoRA run started then resumes bit for bit: Linen folded the first 4 bytes of a SHA-1 of a
module's path and call count into the key (flax.core.scope's LazyRng), and its nn.scan split the key over the
layers before any path was folded in, counting each layer's draws from 2 (nn.scan traces its body twice). The
ways that apply the layers themselves (stack/grouped.py) drew one key for the whole stack first, and split it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp


def fold_in_path(key: jax.Array, *path: str | int) -> jax.Array:
    """key with a module path folded in: strings as their UTF-8 bytes, ints as their big-endian bytes (Linen's)."""
    digest = hashlib.sha1()
    for part in path:
        digest.update(part.encode() if isinstance(part, str) else part.to_bytes((part.bit_length() + 7) // 8, "big"))
    return jax.random.fold_in(key, jnp.uint32(int.from_bytes(digest.digest()[:4], "big")))


def layer_keys(key: jax.Array, n_layers: int, scanned: bool) -> jax.Array:
    """[n_layers] keys, one per layer, from the step's key: split as it is under the plain scan (stack/scan.py),
    or, where the layers are applied one by one (grouped remat, pipeline stages), from the stack's own key."""
    return jax.random.split(key if scanned else fold_in_path(key, 1), n_layers)


@dataclass(frozen=True)
class DropoutKey:
    """A layer's key and the path of the module it is handed to (Block -> attn -> q_proj): mask() is the key of
    that projection's dropout mask."""

    key: jax.Array
    scanned: bool  # the layer ran under the plain scan (its draws counted from 2, under the stack's name)
    path: tuple[str, ...] = ()

    @classmethod
    def of_layer(cls, key: jax.Array, scanned: bool) -> DropoutKey:
        return cls(key, scanned, ("layers",) if scanned else ())

    def child(self, name: str) -> DropoutKey:
        return dataclasses.replace(self, path=(*self.path, name))

    def mask(self) -> jax.Array:
        return fold_in_path(self.key, *self.path, "Dropout_0", 2 if self.scanned else 1)
