"""Hugging Face Llama checkpoints <-> llama-jax params, one tensor at a time: the reading and writing. Which
Hugging Face tensor each parameter is, and in which layout, is hf_tensor_map.py's; config.json is hf_config.py's.

Memory: neither direction ever holds a whole parameter, let alone the model, on the host.
- Reading builds each parameter device by device (jax.make_array_from_single_device_arrays). A
  device's shard is filled in blocks of at most BLOCK_BYTES along its first axis (layers, for the
  stacked ones); each block is read with safetensors' get_slice, which reads only the rows and
  columns that block needs, then converted (dtype, layout, rotary order) and copied into the shard.
  A shard replicated on several devices is read once and copied between them.
- Writing pulls one Hugging Face tensor at a time (one layer of a stacked parameter) off the
  (possibly sharded) devices and streams its rows, converted in blocks of at most BLOCK_BYTES, into
  safetensors files of at most `shard_bytes` (model-0000k-of-0000n.safetensors and
  model.safetensors.index.json, as save_pretrained writes them): the header is computed from the
  shapes first (safetensors_files.py: the safetensors library only writes a whole dict at once).
  In a multi-process run every process takes part in gathering each tensor and process 0 writes.
So reading holds a block at a time and writing the largest single tensor and a block, whatever the
size of the model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils

from llama_jax.config import ModelConfig
from llama_jax.errors import ConfigError
from llama_jax.interop.hf_config import hf_config
from llama_jax.interop.hf_tensor_map import Tensor, half_to_interleaved, tensor_map
from llama_jax.interop.safetensors_files import SHARD_BYTES, Item, SafetensorsReader, write_safetensors
from llama_jax.model.llama import param_shapes

BLOCK_BYTES = 64 * 2**20  # the most a conversion reads or converts at once


# ---------------------------------------------------------------------------------------------
# Reading


def single_device_target(cfg: ModelConfig) -> Any:
    """The params' shapes and param_dtype on this process's first device: where a model goes without a mesh."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), param_shapes(cfg))


def read_params(
    directory: Path, cfg: ModelConfig, target: Any = None, rotary: str = "half", block_bytes: int = BLOCK_BYTES
) -> dict:
    """Our params tree from a Hugging Face directory, each parameter in the shape, dtype and sharding of
    `target` (ShapeDtypeStructs in a tree like the params; None: single_device_target), read and placed
    block by block (module docstring)."""
    target = single_device_target(cfg) if target is None else target
    reader = SafetensorsReader(directory)
    expected = {}
    for tensor in tensor_map(cfg):
        shape = _get(target, tensor.path).shape
        for i in range(cfg.n_layers) if tensor.per_layer else [0]:
            expected[tensor.hf_name.format(i=i)] = tensor.hf_shape(shape[1:] if tensor.per_layer else shape)
    missing = [n for n in expected if n not in reader.files]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConfigError(
            f"{directory} lacks tensor(s) {', '.join(missing[:3])}{more} that a Llama with this config.json needs"
        )
    wrong = [n for n, shape in expected.items() if reader.shapes[n] != shape]
    if wrong:
        raise ConfigError(
            f"{directory}: {wrong[0]} has shape {list(reader.shapes[wrong[0]])} but config.json "
            f"implies {list(expected[wrong[0]])}"
        )
    return read_tensors(reader, tensor_map(cfg), cfg, target, rotary, block_bytes)


def read_tensors(
    reader: SafetensorsReader,
    tensors: list[Tensor],
    cfg: ModelConfig,
    target: Any,
    rotary: str = "half",
    block_bytes: int = BLOCK_BYTES,
) -> dict:
    """The params tree of `tensors` (names and shapes checked by the caller), each parameter in the shape,
    dtype and sharding of `target`, read from `reader` and placed block by block."""
    params: dict = {}
    for tensor in tensors:
        spec = _get(target, tensor.path)

        def read(index, tensor=tensor, dtype=spec.dtype):  # ours[index], in dtype
            def one(name, index):
                block = tensor.from_hf(
                    partial(reader.read, name), index, cfg.resolved_head_dim, rotary == "interleaved"
                )
                return block.astype(dtype, copy=False)

            if not tensor.per_layer:
                return one(tensor.hf_name, index)
            layers = range(index[0].start, index[0].stop)
            out = np.empty((len(layers), *(s.stop - s.start for s in index[1:])), dtype)
            for j, layer in enumerate(layers):
                out[j] = one(tensor.hf_name.format(i=layer), index[1:])
            return out

        _set(params, tensor.path, place(spec.shape, spec.dtype, spec.sharding, read, block_bytes))
    return params


def place(
    shape: tuple[int, ...],
    dtype,
    sharding,
    read: Callable[[tuple[slice, ...]], np.ndarray],
    block_bytes: int = BLOCK_BYTES,
) -> jax.Array:
    """A jax.Array of `shape` in `sharding` whose values are read(index) (slices with start and stop):
    each addressable device's shard is filled in blocks of at most block_bytes along axis 0, so the host
    holds one block at a time; a shard that several devices hold is read once and copied."""
    arrays, placed = [], {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
        key = tuple((s.start, s.stop) for s in index)
        if key in placed:
            arrays.append(jax.device_put(placed[key], device))
            continue
        placed[key] = _fill_shard(index, np.dtype(dtype), device, read, block_bytes)
        arrays.append(placed[key])
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _fill_shard(index: tuple[slice, ...], dtype: np.dtype, device, read, block_bytes: int) -> jax.Array:
    shape = tuple(s.stop - s.start for s in index)
    rows = max(1, block_bytes // max(1, math.prod(shape[1:]) * dtype.itemsize))  # per block
    if rows >= shape[0]:
        return jax.device_put(read(index), device).block_until_ready()
    shard = jnp.zeros(shape, dtype, device=device)
    for start in range(0, shape[0], rows):
        block = read((slice(index[0].start + start, min(index[0].start + start + rows, index[0].stop)), *index[1:]))
        shard = _write_rows(shard, jax.device_put(block, device).block_until_ready(), start)
    return shard


@partial(jax.jit, donate_argnums=(0,))
def _write_rows(shard: jax.Array, block: jax.Array, start) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(shard, block, start, 0)


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# ---------------------------------------------------------------------------------------------
# Writing


def hf_tensors(
    params: dict,
    cfg: ModelConfig,
    dtype,
    rotary: str = "half",
    block_bytes: int = BLOCK_BYTES,
    tensors: list[Tensor] | None = None,
) -> Iterator[Item]:
    """(name, shape, blocks) per Hugging Face tensor of `tensors` (default: the model's, tensor_map), in
    their order. blocks() pulls the tensor (one layer of a stacked parameter) off the devices and yields its
    rows as numpy in `dtype`, in blocks of at most block_bytes, on process 0; the other processes of a
    multi-process run take part and get None."""
    for tensor in tensor_map(cfg) if tensors is None else tensors:
        value = _get(params, tensor.path)
        layer_shape = value.shape[1:] if tensor.per_layer else value.shape
        for i in range(cfg.n_layers) if tensor.per_layer else [None]:
            yield (
                tensor.hf_name.format(i=i),
                tensor.hf_shape(layer_shape),
                partial(
                    _hf_blocks,
                    tensor,
                    value,
                    i,
                    cfg.resolved_head_dim,
                    np.dtype(dtype),
                    rotary == "interleaved",
                    block_bytes,
                ),
            )


def _hf_blocks(
    tensor: Tensor,
    value: jax.Array,
    layer: int | None,
    head_dim: int,
    dtype: np.dtype,
    interleaved: bool,
    block_bytes: int,
) -> Iterator[np.ndarray | None]:
    ours = pull(value, layer)
    if ours is None:
        yield None
        return
    rows = tensor.to_hf(ours)  # a view where the layout allows
    if interleaved and tensor.rotary:
        rows = half_to_interleaved(rows, rows.shape[0] // head_dim)
    step = max(1, block_bytes // max(1, rows[:1].size * max(rows.dtype.itemsize, dtype.itemsize)))
    for start in range(0, rows.shape[0], step):
        yield rows[start : start + step].astype(dtype, order="C")


def pull(value: jax.Array, layer: int | None) -> np.ndarray | None:
    """value[layer] (or all of value) on the host of process 0, gathered from the devices' shards; the
    other processes of a multi-process run must call it too, and get None. Taking the layer on the
    devices first is local to each (the table never splits the layers axis): no device holds more than
    its shards and, in a multi-process run, the layer gathered."""
    # A fresh array either way: the numpy copy of an array stays cached on it, as long as the params live.
    piece = _copy(value) if layer is None else _layer(value, layer)
    if jax.process_count() == 1:
        return np.asarray(piece)
    gathered = multihost_utils.process_allgather(piece, tiled=True)
    return np.asarray(gathered) if jax.process_index() == 0 else None


@jax.jit
def _layer(value: jax.Array, layer) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(value, layer, keepdims=False)


@jax.jit
def _copy(value: jax.Array) -> jax.Array:
    return value * 1


def write_hf(
    directory: Path,
    params: dict,
    cfg: ModelConfig,
    dtype: str = "float32",
    rotary: str = "half",
    shard_bytes: int = SHARD_BYTES,
    block_bytes: int = BLOCK_BYTES,
) -> Path:
    """A Hugging Face Llama directory (config.json + safetensors) from our params, which may be sharded
    over a mesh; in a multi-process run every process calls it and process 0 writes."""
    directory = Path(directory)
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    write_safetensors(directory, list(hf_tensors(params, cfg, np_dtype, rotary, block_bytes)), np_dtype, shard_bytes)
    if jax.process_index() == 0:
        (directory / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    return directory
