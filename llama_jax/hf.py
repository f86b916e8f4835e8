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

Reading streams one Hugging Face tensor at a time from the memory-mapped safetensors files and places
each stacked parameter straight into its shards (jax.make_array_from_callback): the host holds about
one parameter at a time. Writing streams too: the safetensors header is computed from the shapes
first and each tensor's bytes follow, so export needs one tensor of host memory per write (the
safetensors library can only write a whole dict at once, hence our small writer).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open

from llama_jax.config import ModelConfig
from llama_jax.errors import ConfigError

ROTARY_LAYOUTS = ("half", "interleaved")
SHARD_BYTES = 5 * 2**30  # transformers' default shard size


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def read_config(directory: Path) -> ModelConfig:
    """ModelConfig of a Hugging Face Llama directory; ConfigError naming what is not supported."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{directory} has no config.json: not a Hugging Face model directory")
    try:
        hf = json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(f"{path} is not valid JSON ({err})") from None
    architectures = hf.get("architectures") or [hf.get("model_type", "?")]
    if "LlamaForCausalLM" not in architectures and hf.get("model_type") != "llama":
        raise ConfigError(f"{path}: architecture {architectures[0]} is not supported; llama-jax converts "
                          "LlamaForCausalLM (model_type llama)")
    unsupported = [k for k in ("attention_bias", "mlp_bias") if hf.get(k)]
    if hf.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={hf['hidden_act']}")
    if unsupported:
        raise ConfigError(f"{path}: {', '.join(unsupported)} is not supported (Llama 3 has no biases and uses SiLU)")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if k not in hf]
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
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=head_dim, ffn_dim=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048), norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=float(theta), rope_scaling_factor=float(rope.get("factor", 1.0)) if llama3 else 1.0,
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_len=int(rope.get("original_max_position_embeddings", 8192)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def hf_config(cfg: ModelConfig, dtype: str) -> dict:
    """config.json for transformers: the 4.x keys (rope_theta, rope_scaling), which 5.x also reads."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.resolved_head_dim,
        "intermediate_size": cfg.ffn_dim, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
    }
    if cfg.rope_scaling_factor != 1.0:
        config["rope_scaling"] = {
            "rope_type": "llama3", "factor": cfg.rope_scaling_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len}
    return config


# ---------------------------------------------------------------------------------------------
# The tensor map


@dataclass(frozen=True)
class Tensor:
    """One llama-jax parameter and the Hugging Face tensor(s) it is made of."""
    path: tuple[str, ...]  # in our params tree
    hf_name: str  # with {i} for the layer index when per_layer
    per_layer: bool
    to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]  # one HF tensor -> our layout (one layer)
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]


def _heads_in(n_heads: Callable[[ModelConfig], int]):
    """[heads*head_dim, D] -> [D, heads, head_dim] and back."""
    def to_ours(w, cfg):
        return w.T.reshape(cfg.d_model, n_heads(cfg), cfg.resolved_head_dim)

    def to_hf(w, cfg):
        return w.reshape(cfg.d_model, -1).T
    return to_ours, to_hf


def _transposed():
    return (lambda w, cfg: w.T), (lambda w, cfg: w.T)


def _same():
    return (lambda w, cfg: w), (lambda w, cfg: w)


def tensor_map(cfg: ModelConfig) -> list[Tensor]:
    q = _heads_in(lambda c: c.n_heads)
    kv = _heads_in(lambda c: c.n_kv_heads)
    o = ((lambda w, c: w.T.reshape(c.n_heads, c.resolved_head_dim, c.d_model)),
         (lambda w, c: w.reshape(-1, c.d_model).T))
    layer = "model.layers.{i}."
    tensors = [
        Tensor(("embed", "embedding"), "model.embed_tokens.weight", False, *_same()),
        Tensor(("layers", "attn", "q_proj", "kernel"), layer + "self_attn.q_proj.weight", True, *q),
        Tensor(("layers", "attn", "k_proj", "kernel"), layer + "self_attn.k_proj.weight", True, *kv),
        Tensor(("layers", "attn", "v_proj", "kernel"), layer + "self_attn.v_proj.weight", True, *kv),
        Tensor(("layers", "attn", "o_proj", "kernel"), layer + "self_attn.o_proj.weight", True, *o),
        Tensor(("layers", "mlp", "gate_proj", "kernel"), layer + "mlp.gate_proj.weight", True, *_transposed()),
        Tensor(("layers", "mlp", "up_proj", "kernel"), layer + "mlp.up_proj.weight", True, *_transposed()),
        Tensor(("layers", "mlp", "down_proj", "kernel"), layer + "mlp.down_proj.weight", True, *_transposed()),
        Tensor(("layers", "attn_norm", "scale"), layer + "input_layernorm.weight", True, *_same()),
        Tensor(("layers", "mlp_norm", "scale"), layer + "post_attention_layernorm.weight", True, *_same()),
        Tensor(("final_norm", "scale"), "model.norm.weight", False, *_same()),
    ]
    if not cfg.tie_embeddings:
        tensors.append(Tensor(("lm_head", "kernel"), "lm_head.weight", False, *_transposed()))
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


def _rotary_heads(name: str, cfg: ModelConfig) -> int | None:
    """How many heads a q/k projection has (None for other tensors)."""
    if name.endswith("q_proj.weight"):
        return cfg.n_heads
    return cfg.n_kv_heads if name.endswith("k_proj.weight") else None


# ---------------------------------------------------------------------------------------------
# Reading


class SafetensorsReader:
    """Tensors by name from model.safetensors or the shards of model.safetensors.index.json."""

    def __init__(self, directory: Path):
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (directory / "model.safetensors").is_file():
            weight_map = None
        else:
            raise ConfigError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._handles = {f: safe_open(str(directory / f), framework="flax") for f in files}
        self.names = {n: f for f, h in self._handles.items() for n in h.keys()}
        if weight_map:
            self.names = {n: f for n, f in weight_map.items() if n in self.names}

    def get(self, name: str) -> np.ndarray:
        """The tensor as numpy, in its stored dtype (bfloat16 via ml_dtypes)."""
        return np.asarray(self._handles[self.names[name]].get_tensor(name))


def read_params(directory: Path, cfg: ModelConfig, shardings=None, dtype=None, rotary: str = "half") -> dict:
    """Our params tree from a Hugging Face directory. Each stacked parameter is built on the host and
    placed in its shardings (a tree like the params; None: the default device), then dropped."""
    reader = SafetensorsReader(directory)
    expected = [t.hf_name.format(i=i) for t in tensor_map(cfg) for i in (range(cfg.n_layers) if t.per_layer else [0])]
    missing = [n for n in expected if n not in reader.names]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConfigError(f"{directory} lacks tensor(s) {', '.join(missing[:3])}{more} that a Llama with this "
                          "config.json needs")
    params: dict = {}
    for tensor in tensor_map(cfg):
        layers = [reader.get(tensor.hf_name.format(i=i)) for i in (range(cfg.n_layers) if tensor.per_layer else [0])]
        heads = _rotary_heads(tensor.hf_name, cfg)
        if rotary == "interleaved" and heads:
            layers = [interleaved_to_half(w, heads) for w in layers]
        ours = [tensor.to_ours(w, cfg) for w in layers]
        value = np.stack(ours) if tensor.per_layer else ours[0]
        if dtype is not None:
            value = value.astype(dtype)
        sharding = _get(shardings, tensor.path) if shardings is not None else None
        placed = jax.make_array_from_callback(value.shape, sharding, lambda index, v=value: v[index]) \
            if sharding is not None else jax.numpy.asarray(value)
        _set(params, tensor.path, placed)
    return params


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


def hf_tensors(params: dict, cfg: ModelConfig, dtype, rotary: str = "half"
               ) -> Iterator[tuple[str, Callable[[], np.ndarray], tuple[int, ...]]]:
    """(name, load, shape) in transformers' order; load() returns the tensor as numpy in `dtype`, so a
    writer pulls one tensor off the devices at a time."""
    for tensor in tensor_map(cfg):
        for i in range(cfg.n_layers) if tensor.per_layer else [None]:
            def load(tensor=tensor, i=i):
                value = _get(params, tensor.path)
                value = np.asarray(jax.device_get(value[i] if i is not None else value))
                out = tensor.to_hf(value, cfg)
                heads = _rotary_heads(tensor.hf_name, cfg)
                if rotary == "interleaved" and heads:
                    out = half_to_interleaved(out, heads)
                return np.ascontiguousarray(out.astype(dtype))
            shape_source = _get(params, tensor.path)
            yield tensor.hf_name.format(i=i), load, _hf_shape(tensor, shape_source.shape, cfg)


def _hf_shape(tensor: Tensor, our_shape: tuple[int, ...], cfg: ModelConfig) -> tuple[int, ...]:
    layer_shape = our_shape[1:] if tensor.per_layer else our_shape
    return tensor.to_hf(np.empty(layer_shape, np.int8), cfg).shape


def write_safetensors(directory: Path, items: list[tuple[str, Callable, tuple[int, ...]]], dtype,
                      shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write tensors as safetensors files of at most shard_bytes (one file if it fits), streaming each
    tensor's bytes; with several files, also model.safetensors.index.json. Returns the file names."""
    dtype = np.dtype(dtype)
    code = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}.get(dtype, "BF16")
    sizes = [math.prod(shape) * dtype.itemsize for _, _, shape in items]
    groups, current, used = [], [], 0
    for item, size in zip(items, sizes):
        if current and used + size > shard_bytes:
            groups.append(current)
            current, used = [], 0
        current.append((item, size))
        used += size
    groups.append(current)
    names = ["model.safetensors"] if len(groups) == 1 else \
        [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    weight_map = {}
    for name, group in zip(names, groups):
        header, offset = {}, 0
        for (tensor_name, _, shape), size in group:
            header[tensor_name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[tensor_name] = name
        header["__metadata__"] = {"format": "pt"}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        with open(directory / name, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for (_, load, shape), _size in group:
                f.write(load().tobytes())
    if len(names) > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, indent=2) + "\n")
    return names


def write_hf(directory: Path, params: dict, cfg: ModelConfig, dtype: str = "float32", rotary: str = "half",
             shard_bytes: int = SHARD_BYTES) -> Path:
    """A Hugging Face Llama directory (config.json + safetensors) from our params."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    items = list(hf_tensors(params, cfg, np_dtype, rotary))
    write_safetensors(directory, items, np_dtype, shard_bytes)
    (directory / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    return directory
