"""Activation recomputation policies: each named policy is a list of the tensors it keeps.

The model tags its activations with ``checkpoint_name`` (the names in ``TAGS``). During the backward
pass a layer needs its activations; a policy says which of them are saved from the forward pass —
everything untagged or not listed is recomputed from the layer's input, which the layer scan always
keeps.
"""

from __future__ import annotations

from typing import Callable

import jax

# Every activation the model tags, in the order a layer computes them.
TAGS = (
    "attn_norm",          # RMSNorm output before attention        [batch, seq, embed]
    "query_proj",         # q = x Wq                                [batch, seq, heads, head_dim]
    "key_proj",           # k = x Wk                                [batch, seq, kv_heads, head_dim]
    "value_proj",         # v = x Wv                                [batch, seq, kv_heads, head_dim]
    "attention_context",  # softmax(q kᵀ) v, the attention core     [batch, seq, heads, head_dim]
    "attention_out",      # context Wo                              [batch, seq, embed]
    "mlp_norm",           # RMSNorm output before the MLP           [batch, seq, embed]
    "mlp_gate",           # x Wgate                                 [batch, seq, mlp]
    "mlp_up",             # x Wup                                   [batch, seq, mlp]
    "mlp_hidden",         # silu(gate) * up                         [batch, seq, mlp]
    "mlp_out",            # hidden Wdown                            [batch, seq, embed]
)

_MATMUL_OUTPUTS = ("query_proj", "key_proj", "value_proj", "attention_context", "attention_out",
                   "mlp_gate", "mlp_up", "mlp_out")

# None means: no recomputation at all (the layer is not wrapped in remat).
POLICIES: dict[str, tuple[str, ...] | None] = {
    "none": None,
    # Keep only the layer input (held by the scan): recompute the whole layer, about one extra forward.
    "full": (),
    # Megatron's selective recomputation: keep every tagged tensor, recompute only the attention
    # core's internals (q kᵀ scores and softmax), which grow with seq² and are cheap to redo.
    "selective": TAGS,
    # Keep every matmul output; norms, rotary and the SwiGLU product are recomputed.
    "minimal": _MATMUL_OUTPUTS,
    "save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
    "save_dot_except_mlp": ("query_proj", "key_proj", "value_proj", "attention_context", "attention_out"),
}


def check_policy_name(name: str) -> None:
    if name not in POLICIES:
        from llama_jax.config import ConfigError

        raise ConfigError(f"unknown remat.policy '{name}'; valid policies: {', '.join(POLICIES)}")


def checkpoint_policy(name: str) -> Callable | None:
    """The jax.checkpoint policy for a named policy, or None when the layer is not rematerialised."""
    check_policy_name(name)
    saved = POLICIES[name]
    if saved is None:
        return None
    return jax.checkpoint_policies.save_only_these_names(*saved)
