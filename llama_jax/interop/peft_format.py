"""Adapters in Hugging Face PEFT's format: `adapter_config.json` + `adapter_model.safetensors`, the
directory `PeftModel.from_pretrained(base_model, DIR)` loads.

    LoRA (per layer i, torch [out, in])                           llama-jax (layers stacked on axis 0)
    base_model.model.model.layers.i.self_attn.q_proj.lora_A.weight [r, D]      .../q_proj/lora_a [L, D, r]
                                               q_proj.lora_B.weight [N*H, r]   .../q_proj/lora_b [L, r, N, H]
                                               o_proj.lora_A.weight [r, N*H]   .../o_proj/lora_a [L, N, H, r]
    ... mlp.{gate,up,down}_proj.lora_{A,B}.weight, k_proj, v_proj alike
    prompt tuning:  prompt_embeddings [P, D]                      prompt/embedding [P, D]

An adapter's A has the input axes of the weight it adapts and B its output axes, so each one maps onto
Hugging Face with a layout of hf_tensor_map.py's (q's B like q's weight, o's A like o's weight, the rest
transposed), and is written by safetensors_files.py's streaming writer. P-tuning is written as prompt
tuning: its encoder is dropped and the virtual tokens it makes are the prompt (PEFT saves a P-tuning
adapter the same way, as `prompt_embeddings`).

Reading goes the other way, for a PEFT adapter directory made by PEFT or by us: its LoRA or prompt-tuning
adapters become our adapters (read_settings: adapter_config.json -> peft.* settings; read_adapter: the
tensors, in any of fp32/bf16/fp16, with or without PEFT's `base_model.model.` prefix). What our model cannot
compute the same way is refused in one line, not approximated: DoRA, trained biases, per-module ranks or
alphas, adapters on some layers only, modules_to_save, LoRA on the embedding or the head. rsLoRA's scale
alpha / sqrt(r) is ours, alpha / r, with alpha scaled by sqrt(r).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax.traverse_util import flatten_dict

from llama_jax.config import ModelConfig, PeftConfig
from llama_jax.errors import ConfigError
from llama_jax.interop import hf
from llama_jax.interop.hf_tensor_map import Tensor, tensor_map
from llama_jax.interop.safetensors_files import SafetensorsReader, write_safetensors
from llama_jax.model import peft
from llama_jax.model.llama import param_shapes

ADAPTER_CONFIG = "adapter_config.json"
LORA_PREFIX = "base_model.model."  # PEFT's wrapper around transformers' LlamaForCausalLM


def lora_tensors(cfg: ModelConfig, settings: PeftConfig) -> list[Tensor]:
    """The Hugging Face tensors of the LoRA adapters on settings.targets, in transformers' layer order."""
    tensors = []
    for base in tensor_map(cfg):
        projection = base.path[-2]  # q_proj ... down_proj
        if base.path[-1] != "kernel" or projection.removesuffix("_proj") not in settings.targets:
            continue
        name = LORA_PREFIX + base.hf_name.removesuffix(".weight")
        a_layout = "heads_out" if base.layout == "heads_out" else "transposed"
        b_layout = "heads_in" if base.layout == "heads_in" else "transposed"
        tensors += [
            Tensor(base.path[:-1] + ("lora_a",), name + ".lora_A.weight", True, a_layout),
            Tensor(base.path[:-1] + ("lora_b",), name + ".lora_B.weight", True, b_layout),
        ]
    return tensors


def adapter_config(cfg: ModelConfig, settings: PeftConfig, base_model: str) -> dict:
    """adapter_config.json: the keys PEFT needs to rebuild the adapters (it fills in the rest)."""
    common = {"task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "inference_mode": True}
    if settings.method == "lora":
        return {
            **common,
            "peft_type": "LORA",
            "r": settings.rank,
            "lora_alpha": settings.alpha,
            "lora_dropout": settings.dropout,
            "target_modules": [f"{t}_proj" for t in settings.targets],
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
        }
    return {
        **common,
        "peft_type": "PROMPT_TUNING",
        "num_virtual_tokens": settings.prompt_tokens,
        "token_dim": cfg.d_model,
        "num_transformer_submodules": 1,
        "num_attention_heads": cfg.n_heads,
        "num_layers": cfg.n_layers,
        "prompt_tuning_init": "RANDOM",
    }


def write_adapter(
    directory: Path,
    adapters: dict,
    cfg: ModelConfig,
    settings: PeftConfig,
    base_model: str,
    dtype: str = "float32",
    rotary: str = "half",
) -> Path:
    """A PEFT adapter directory from a peft run's adapters (peft.split's first half, possibly sharded); in a
    multi-process run every process calls it and process 0 writes."""
    directory = Path(directory)
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    if settings.method == "lora":
        tensors = lora_tensors(cfg, settings)
    else:
        adapters = {"prompt": {"embedding": peft.prompt_table(adapters, cfg, settings)}}
        tensors = [Tensor(("prompt", "embedding"), "prompt_embeddings", False, "same")]
    items = list(hf.hf_tensors(adapters, cfg, np_dtype, rotary, tensors=tensors))
    write_safetensors(directory, items, np_dtype, stem="adapter_model")
    if jax.process_index() == 0:
        config = adapter_config(cfg, settings, base_model)
        (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return directory


# ---------------------------------------------------------------------------------------------
# Reading


PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # the targets our LoRA adapts, in the model's order
# adapter_config.json keys whose other values ask for something our adapters do not compute: key -> (the
# values that are ours, what a value outside them is).
UNSUPPORTED = {
    "use_dora": ((False, None), "DoRA (use_dora: true)"),
    "bias": (("none", None), "trained biases (bias: {value})"),
    "lora_bias": ((False, None), "LoRA biases (lora_bias: true)"),
    "rank_pattern": (({}, None), "per-module ranks (rank_pattern)"),
    "alpha_pattern": (({}, None), "per-module alphas (alpha_pattern)"),
    "layers_to_transform": ((None, []), "adapters on some layers only (layers_to_transform)"),
    "modules_to_save": ((None, []), "fully trained modules (modules_to_save: {value})"),
    "fan_in_fan_out": ((False, None), "transposed weights (fan_in_fan_out: true)"),
    "layer_replication": ((None, []), "replicated layers (layer_replication)"),
    "target_parameters": ((None, []), "adapted parameters (target_parameters)"),
    "trainable_token_indices": ((None, [], {}), "trainable token rows (trainable_token_indices)"),
}
_LORA_NAME = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)_proj\.lora_[AB]\.weight")


def read_config(directory: Path) -> dict:
    """adapter_config.json as a dict (ConfigError when it is missing or not JSON)."""
    path = Path(directory) / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{path} cannot be read as JSON ({err}); a PEFT adapter directory holds "
            f"{ADAPTER_CONFIG} and adapter_model.safetensors"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object; a PEFT adapter directory holds {ADAPTER_CONFIG}")
    return config


def read_settings(directory: Path, cfg: ModelConfig) -> PeftConfig:
    """The peft.* settings of a PEFT adapter directory on a model of `cfg`; ConfigError (one line) for an
    adapter our model does not compute the same way, or one made for a base of other shapes."""
    config, where = read_config(directory), Path(directory)
    kind = config.get("peft_type")
    if kind == "PROMPT_TUNING":
        return _prompt_settings(config, cfg, where)
    if kind != "LORA":
        raise ConfigError(
            f"{where} holds a PEFT adapter of type {kind}; llama-jax reads LORA and PROMPT_TUNING adapters"
        )
    for key, (ours, what) in UNSUPPORTED.items():
        if config.get(key) not in ours:
            raise ConfigError(
                f"{where} uses {what.format(value=config.get(key))}, which llama-jax's LoRA does not "
                "compute; merge it into the base with PEFT (merge_and_unload) and load that instead"
            )
    reader = SafetensorsReader(where, stem="adapter_model")
    targets = _lora_targets(reader, cfg, where)
    rank = int(config.get("r", 0))
    if rank <= 0:
        raise ConfigError(f"{where / ADAPTER_CONFIG}: r must be a positive rank, got {config.get('r')}")
    alpha = float(config.get("lora_alpha", rank))
    settings = PeftConfig(
        method="lora",
        rank=rank,
        alpha=alpha * math.sqrt(rank) if config.get("use_rslora") else alpha,
        targets=targets,
        dropout=float(config.get("lora_dropout") or 0.0),
    )
    _check_shapes(reader, adapter_tensors(cfg, settings, reader), cfg, settings, where)
    return settings


def _prompt_settings(config: dict, cfg: ModelConfig, where: Path) -> PeftConfig:
    """A prompt-tuning adapter: its virtual tokens, for a decoder (one transformer submodule) of our width."""
    if config.get("num_transformer_submodules", 1) != 1:
        raise ConfigError(
            f"{where} is a prompt for an encoder-decoder model (num_transformer_submodules: "
            f"{config['num_transformer_submodules']}); a Llama takes a decoder's prompt"
        )
    settings = PeftConfig(method="prompt", prompt_tokens=int(config.get("num_virtual_tokens", 0)))
    reader = SafetensorsReader(where, stem="adapter_model")
    _check_shapes(reader, adapter_tensors(cfg, settings, reader), cfg, settings, where)
    return settings


def _lora_targets(reader: SafetensorsReader, cfg: ModelConfig, where: Path) -> list[str]:
    """The projections the file's LoRA tensors adapt, each on every layer (ConfigError otherwise)."""
    found: dict[str, set[int]] = {}
    for name in reader.files:
        match = _LORA_NAME.fullmatch(name.removeprefix(LORA_PREFIX))
        if match is None or match.group(2) not in PROJECTIONS:
            raise ConfigError(
                f"{where}: tensor {name} is not the LoRA A or B of a Llama projection (llama-jax "
                f"adapts {', '.join(f'{p}_proj' for p in PROJECTIONS)})"
            )
        found.setdefault(match.group(2), set()).add(int(match.group(1)))
    for target, layers in found.items():
        if layers != set(range(cfg.n_layers)):
            raise ConfigError(
                f"{where} adapts {target}_proj on layers {_span(layers)} but the base model has "
                f"{cfg.n_layers} layers: the adapter was made for another base model"
            )
    if not found:
        raise ConfigError(f"{where}: adapter_model.safetensors holds no LoRA tensors")
    return [p for p in PROJECTIONS if p in found]


def _span(layers: set[int]) -> str:
    return f"{min(layers)}-{max(layers)}" if max(layers) - min(layers) + 1 == len(layers) else str(sorted(layers))


def adapter_tensors(cfg: ModelConfig, settings: PeftConfig, reader: SafetensorsReader | None = None) -> list[Tensor]:
    """The tensors of `settings`' adapters under the names `reader`'s file uses (PEFT's, with or without its
    `base_model.model.` prefix)."""
    if settings.method != "lora":
        return [Tensor(("prompt", "embedding"), "prompt_embeddings", False, "same")]
    tensors = lora_tensors(cfg, settings)
    if reader is not None and not any(name.startswith(LORA_PREFIX) for name in reader.files):
        tensors = [Tensor(t.path, t.hf_name.removeprefix(LORA_PREFIX), t.per_layer, t.layout) for t in tensors]
    return tensors


def _check_shapes(
    reader: SafetensorsReader, tensors: list[Tensor], cfg: ModelConfig, settings: PeftConfig, where: Path
) -> None:
    """Every tensor of `tensors` is in the file with the shape our adapter of `settings` on `cfg` has."""
    shapes = flatten_dict(peft.split(param_shapes(cfg, settings))[0])
    for tensor in tensors:
        ours = shapes[tensor.path].shape
        expected = tensor.hf_shape(ours[1:] if tensor.per_layer else ours)
        for i in range(cfg.n_layers) if tensor.per_layer else [0]:
            name = tensor.hf_name.format(i=i)
            if name not in reader.shapes:
                raise ConfigError(f"{where} lacks tensor {name}")
            if reader.shapes[name] != expected:
                raise ConfigError(
                    f"{where}: {name} has shape {list(reader.shapes[name])} where a {_what(settings)} on "
                    f"this base model has {list(expected)}: the adapter was made for another base "
                    "model (or its adapter_config.json does not match its tensors)"
                )


def _what(settings: PeftConfig) -> str:
    return f"rank-{settings.rank} LoRA" if settings.method == "lora" else f"{settings.prompt_tokens}-token prompt"


def read_adapter(directory: Path, cfg: ModelConfig, settings: PeftConfig, target: Any) -> dict:
    """The adapters of a PEFT adapter directory (read_settings' `settings`) in our layout: a tree like
    peft.split's first half, each in the shape, dtype and sharding of `target`'s ShapeDtypeStruct."""
    reader = SafetensorsReader(Path(directory), stem="adapter_model")
    return hf.read_tensors(reader, adapter_tensors(cfg, settings, reader), cfg, target)
