"""Hugging Face Llama checkpoints <-> llama-jax params, one tensor at a time.

    Hugging Face (per layer i, torch [out, in])         llama-jax (layers stacked on axis 0)
    model.embed_tokens.weight            [V, D]         embed/embedding                [V, D]
    model.layers.i.self_attn.q_proj      [N*H, D]       layers/attn/q_proj/kernel      [L, D, N, H]
                             k_proj/v_proj [K*H, D]     layers/attn/{k,v}_proj/kernel  [L, D, K, H]
                             o_proj      [D, N*H]       layers/attn/o_proj/kernel      [L, N, H, D]
    model.layers.i.mlp.gate_proj/up_proj [F, D]         layers/mlp/{gate,up}_proj/kernel [L, D, F]
                       down_proj         [D, F]         layers/mlp/down_proj/kernel    [L, F, D]
    model.layers.i.input_layernorm       [D]            layers/attn_norm/scale         [L, D]
    model.layers.i.post_attention_layernorm [D]         layers/mlp_norm/scale          [L, D]
    model.norm.weight                    [D]            final_norm/scale               [D]
    lm_head.weight                       [V, D]         lm_head/kernel                 [D, V]  (absent when tied)

Rotary layout: our model and transformers rotate (x[i], x[i + H/2]) ("rotate_half"); Meta's original
checkpoints rotate interleaved pairs (x[2i], x[2i+1]). With rotary="interleaved" the q/k rows of each
head are reordered between the two (evens first, then odds), as transformers' own conversion does.

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
from dataclasses import dataclass
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
from llama_jax.interop.safetensors_files import SHARD_BYTES, Item, SafetensorsReader, write_safetensors
from llama_jax.model.llama import param_shapes

ROTARY_LAYOUTS = ("half", "interleaved")
BLOCK_BYTES = 64 * 2**20  # the most a conversion reads or converts at once


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def read_config(directory: Path) -> ModelConfig:
    """ModelConfig of a Hugging Face Llama directory; ConfigError naming what is not supported."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{directory} has no config.json: not a Hugging Face model directory")
    try:
        hf = json.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read {path} ({err.strerror}); check that it is readable") from None
    except ValueError as err:
        raise ConfigError(f"{path} is not valid JSON ({err})") from None
    architectures = hf.get("architectures") or [hf.get("model_type", "?")]
    if "LlamaForCausalLM" not in architectures and hf.get("model_type") != "llama":
        raise ConfigError(
            f"{path}: architecture {architectures[0]} is not supported; llama-jax converts "
            "LlamaForCausalLM (model_type llama)"
        )
    unsupported = [k for k in ("attention_bias", "mlp_bias") if hf.get(k)]
    if hf.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={hf['hidden_act']}")
    if unsupported:
        raise ConfigError(f"{path}: {', '.join(unsupported)} is not supported (Llama 3 has no biases and uses SiLU)")
    missing = [
        k
        for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        if k not in hf
    ]
    if missing:
        raise ConfigError(f"{path} lacks {', '.join(missing)}")
    # transformers 4.x: rope_theta + rope_scaling; 5.x: rope_parameters (holding rope_theta too).
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"{path}: rope type '{rope_type}' is not supported (default or llama3)")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    llama3 = rope_type == "llama3"
    # 0 = d_model / n_heads, as in our presets: transformers 5.x writes head_dim even when it is implied.
    head_dim = hf.get("head_dim") or 0
    if head_dim * hf["num_attention_heads"] == hf["hidden_size"]:
        head_dim = 0
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=head_dim,
        ffn_dim=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=float(theta),
        rope_scaling_factor=float(rope.get("factor", 1.0)) if llama3 else 1.0,
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_len=int(rope.get("original_max_position_embeddings", 8192)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def hf_config(cfg: ModelConfig, dtype: str) -> dict:
    """config.json for transformers: the 4.x keys (rope_theta, rope_scaling), which 5.x also reads."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "intermediate_size": cfg.ffn_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    if cfg.rope_scaling_factor != 1.0:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
        }
    return config


# ---------------------------------------------------------------------------------------------
# The tensor map


@dataclass(frozen=True)
class Tensor:
    """One llama-jax parameter and the Hugging Face tensor(s) it is made of. `layout` says how one
    layer of ours (left) and the Hugging Face tensor (right) hold the same numbers:

        same        ours[...] == hf[...]                         embedding, norms
        transposed  ours[i, j] == hf[j, i]                       MLP, lm_head
        heads_in    ours[d, n, h] == hf[n * head_dim + h, d]     q, k, v projections
        heads_out   ours[n, h, d] == hf[d, n * head_dim + h]     o projection
    """

    path: tuple[str, ...]  # in our params tree
    hf_name: str  # with {i} for the layer index when per_layer
    per_layer: bool
    layout: str

    @property
    def row_axis(self) -> int:
        """The axis of ours (one layer) along which the Hugging Face tensor's rows run."""
        return {"same": 0, "transposed": 1, "heads_in": 1, "heads_out": 2}[self.layout]

    @property
    def rotary(self) -> bool:
        """Whether the rows are rotated by RoPE (q and k, and the B of their LoRA adapters), so their order
        depends on the rotary layout."""
        return self.hf_name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.lora_B.weight", "k_proj.lora_B.weight"))

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face tensor's shape for one layer of ours of `shape`."""
        if self.layout == "same":
            return tuple(shape)
        if self.layout == "transposed":
            return tuple(shape[::-1])
        if self.layout == "heads_in":
            return shape[1] * shape[2], shape[0]
        return shape[2], shape[0] * shape[1]

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        """A block of ours (one layer, any range along row_axis) -> those rows of the Hugging Face tensor."""
        if self.layout == "same":
            return w
        if self.layout == "transposed":
            return w.T
        if self.layout == "heads_in":
            return w.reshape(w.shape[0], -1).T
        return w.reshape(-1, w.shape[-1]).T

    def from_hf(
        self,
        read: Callable[[tuple[slice, ...]], np.ndarray],
        index: tuple[slice, ...],
        head_dim: int,
        interleaved: bool,
    ) -> np.ndarray:
        """ours[index] (one layer; slices with start and stop), reading only the Hugging Face rows and
        columns it needs with read(hf_index)."""
        if self.layout == "same":
            return read(index)
        if self.layout == "transposed":
            return read(index[::-1]).T
        if self.layout == "heads_in":
            d, n, h = index
            w = read((slice(n.start * head_dim, n.stop * head_dim), d))  # [n * head_dim, d]
            if interleaved and self.rotary:
                w = interleaved_to_half(w, n.stop - n.start)
            return w.reshape(n.stop - n.start, head_dim, -1)[:, h].transpose(2, 0, 1)
        n, h, d = index
        w = read((d, slice(n.start * head_dim, n.stop * head_dim)))  # [d, n * head_dim]
        return w.reshape(w.shape[0], n.stop - n.start, head_dim)[:, :, h].transpose(1, 2, 0)


def tensor_map(cfg: ModelConfig) -> list[Tensor]:
    layer = "model.layers.{i}."
    tensors = [
        Tensor(("embed", "embedding"), "model.embed_tokens.weight", False, "same"),
        Tensor(("layers", "attn", "q_proj", "kernel"), layer + "self_attn.q_proj.weight", True, "heads_in"),
        Tensor(("layers", "attn", "k_proj", "kernel"), layer + "self_attn.k_proj.weight", True, "heads_in"),
        Tensor(("layers", "attn", "v_proj", "kernel"), layer + "self_attn.v_proj.weight", True, "heads_in"),
        Tensor(("layers", "attn", "o_proj", "kernel"), layer + "self_attn.o_proj.weight", True, "heads_out"),
        Tensor(("layers", "mlp", "gate_proj", "kernel"), layer + "mlp.gate_proj.weight", True, "transposed"),
        Tensor(("layers", "mlp", "up_proj", "kernel"), layer + "mlp.up_proj.weight", True, "transposed"),
        Tensor(("layers", "mlp", "down_proj", "kernel"), layer + "mlp.down_proj.weight", True, "transposed"),
        Tensor(("layers", "attn_norm", "scale"), layer + "input_layernorm.weight", True, "same"),
        Tensor(("layers", "mlp_norm", "scale"), layer + "post_attention_layernorm.weight", True, "same"),
        Tensor(("final_norm", "scale"), "model.norm.weight", False, "same"),
    ]
    if not cfg.tie_embeddings:
        tensors.append(Tensor(("lm_head", "kernel"), "lm_head.weight", False, "transposed"))
    return tensors


def interleaved_to_half(w: np.ndarray, n_heads: int) -> np.ndarray:
    """q/k rows of Meta's interleaved rotary layout -> rotate_half: per head, even rows then odd rows."""
    heads = w.reshape(n_heads, -1, w.shape[-1])
    return np.concatenate([heads[:, 0::2], heads[:, 1::2]], axis=1).reshape(w.shape)


def half_to_interleaved(w: np.ndarray, n_heads: int) -> np.ndarray:
    heads = w.reshape(n_heads, -1, w.shape[-1])
    half = heads.shape[1] // 2
    out = np.empty_like(heads)
    out[:, 0::2], out[:, 1::2] = heads[:, :half], heads[:, half:]
    return out.reshape(w.shape)


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
