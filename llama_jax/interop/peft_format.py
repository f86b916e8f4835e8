"""Adapters in Hugging Face PEFT's format: `adapter_config.json` + `adapter_model.safetensors`, the
directory `PeftModel.from_pretrained(base_model, DIR)` loads.

    LoRA (per layer i, torch [out, in])                           llama-jax (layers stacked on axis 0)
    base_model.model.model.layers.i.self_attn.q_proj.lora_A.weight [r, D]      .../q_proj/lora_a [L, D, r]
                                               q_proj.lora_B.weight [N*H, r]   .../q_proj/lora_b [L, r, N, H]
                                               o_proj.lora_A.weight [r, N*H]   .../o_proj/lora_a [L, N, H, r]
    ... mlp.{gate,up,down}_proj.lora_{A,B}.weight, k_proj, v_proj alike
    prompt tuning:  prompt_embeddings [P, D]                      prompt/embedding [P, D]

An adapter's A has the input axes of the weight it adapts and B its output axes, so each one maps onto
Hugging Face with a layout of hf.py's tensor map (q's B like q's weight, o's A like o's weight, the rest
transposed), and is written by hf.py's streaming safetensors writer. P-tuning is written as prompt
tuning: its encoder is dropped and the virtual tokens it makes are the prompt (PEFT saves a P-tuning
adapter the same way, as `prompt_embeddings`).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from llama_jax.config import ModelConfig, PeftConfig
from llama_jax.interop import hf
from llama_jax.model import peft

ADAPTER_CONFIG = "adapter_config.json"
LORA_PREFIX = "base_model.model."  # PEFT's wrapper around transformers' LlamaForCausalLM


def lora_tensors(cfg: ModelConfig, settings: PeftConfig) -> list[hf.Tensor]:
    """The Hugging Face tensors of the LoRA adapters on settings.targets, in transformers' layer order."""
    tensors = []
    for base in hf.tensor_map(cfg):
        projection = base.path[-2]  # q_proj ... down_proj
        if base.path[-1] != "kernel" or projection.removesuffix("_proj") not in settings.targets:
            continue
        name = LORA_PREFIX + base.hf_name.removesuffix(".weight")
        a_layout = "heads_out" if base.layout == "heads_out" else "transposed"
        b_layout = "heads_in" if base.layout == "heads_in" else "transposed"
        tensors += [hf.Tensor(base.path[:-1] + ("lora_a",), name + ".lora_A.weight", True, a_layout),
                    hf.Tensor(base.path[:-1] + ("lora_b",), name + ".lora_B.weight", True, b_layout)]
    return tensors


def adapter_config(cfg: ModelConfig, settings: PeftConfig, base_model: str) -> dict:
    """adapter_config.json: the keys PEFT needs to rebuild the adapters (it fills in the rest)."""
    common = {"task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "inference_mode": True}
    if settings.method == "lora":
        return {**common, "peft_type": "LORA", "r": settings.rank, "lora_alpha": settings.alpha,
                "lora_dropout": settings.dropout, "target_modules": [f"{t}_proj" for t in settings.targets],
                "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
                "init_lora_weights": True}
    return {**common, "peft_type": "PROMPT_TUNING", "num_virtual_tokens": settings.prompt_tokens,
            "token_dim": cfg.d_model, "num_transformer_submodules": 1, "num_attention_heads": cfg.n_heads,
            "num_layers": cfg.n_layers, "prompt_tuning_init": "RANDOM"}


def write_adapter(directory: Path, adapters: dict, cfg: ModelConfig, settings: PeftConfig, base_model: str,
                  dtype: str = "float32", rotary: str = "half") -> Path:
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
        tensors = [hf.Tensor(("prompt", "embedding"), "prompt_embeddings", False, "same")]
    items = list(hf.hf_tensors(adapters, cfg, np_dtype, rotary, tensors=tensors))
    hf.write_safetensors(directory, items, np_dtype, stem="adapter_model")
    if jax.process_index() == 0:
        config = adapter_config(cfg, settings, base_model)
        (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return directory
