"""What the model costs per token, from its config alone: the parameters that take part in matmuls and the model
FLOPs of a training step (PaLM's definition), for MFU and the plans."""

from __future__ import annotations

from llama_jax.config import ModelConfig


def matmul_param_count(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: everything but the embedding lookup and norms.

    The output projection is a matmul (it is the embedding table itself when tied).
    """
    head_dim = cfg.resolved_head_dim
    attention = cfg.d_model * head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    mlp = 3 * cfg.d_model * cfg.ffn_dim
    return cfg.n_layers * (attention + mlp) + cfg.d_model * cfg.vocab_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int, causal_skip: bool = False) -> float:
    """Model FLOPs to train on one token (forward + backward), PaLM's definition.

    6 x (parameters used in matmuls, including the output projection) plus the attention scores and
    weighted sum, 12 x layers x heads x head_dim x seq. That is the full seq x seq attention (as PaLM
    and MaxText's default count it), computed by XLA's kernel; a kernel that skips the causal mask's
    future half (blocked or cuDNN flash attention: causal_skip) is credited with half of it.
    Recomputation is not counted: it is overhead, not model work.
    """
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.resolved_head_dim * seq_len
    return 6 * matmul_param_count(cfg) + (attention / 2 if causal_skip else attention)
