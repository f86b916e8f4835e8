"""config.json <-> ModelConfig: the Hugging Face Llama config a directory holds, read as our model's settings
(refusing, in one ConfigError line, what llama-jax's Llama does not have: biases, other activations or rope
types), and the config.json written next to exported weights, in the keys both transformers 4.x and 5.x read.
"""

from __future__ import annotations

import json
from pathlib import Path

from llama_jax.config import ModelConfig
from llama_jax.errors import ConfigError


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
