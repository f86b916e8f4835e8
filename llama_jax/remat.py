"""Activation recomputation policies: each named policy says, tensor by tensor, what the backward
pass gets from the forward pass.

The model tags its activations with ``checkpoint_name`` (the names in ``TAGS``). For each tag a
policy chooses one action:
    save       keep it in device memory
    offload    move it to pinned host memory during the forward, bring it back for the backward
    recompute  drop it and recompute it from the layer input (which the layer scan always keeps)
Untagged intermediates (attention scores, softmax, rotary, ...) are always recomputed.
"""

from __future__ import annotations

from typing import Callable

import jax

from llama_jax.config import ConfigError, RematConfig

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
ACTIONS = ("save", "offload", "recompute")

_QKV = ("query_proj", "key_proj", "value_proj")
_PROJECTIONS = _QKV + ("attention_out", "mlp_gate", "mlp_up", "mlp_out")
_MATMUL_OUTPUTS = _PROJECTIONS + ("attention_context",)


def _all(tags: tuple[str, ...], action: str) -> dict[str, str]:
    return {tag: action for tag in tags}


# None: no recomputation at all (the layer is not wrapped in remat). Tags left out are recomputed.
POLICIES: dict[str, dict[str, str] | None] = {
    "none": None,
    # Keep only the layer input: recompute the whole layer, about one extra forward pass.
    "full": {},
    # Megatron's selective recomputation: keep every projection output and recompute the attention
    # core (q kᵀ, softmax, their product with v: what a fused kernel would keep), which is cheap
    # next to the projections, plus the elementwise norms and SwiGLU product.
    "selective": _all(_PROJECTIONS, "save"),
    # Keep every matmul output, the attention core's too; norms, rotary and SwiGLU are recomputed.
    "minimal": _all(_MATMUL_OUTPUTS, "save"),
    "save_qkv_proj": _all(_QKV, "save"),
    "save_dot_except_mlp": _all(_QKV + ("attention_context", "attention_out"), "save"),
    # The same choices with the kept tensors in pinned host memory instead of HBM (GPU/TPU).
    "minimal_offload": _all(_MATMUL_OUTPUTS, "offload"),
    "qkv_proj_offload": _all(_QKV, "offload"),
}


def check(remat: RematConfig, n_layers: int) -> None:
    if remat.policy not in POLICIES:
        raise ConfigError(f"unknown remat.policy '{remat.policy}'; valid policies: {', '.join(POLICIES)}")
    for tag, action in remat.custom.items():
        if tag not in TAGS:
            raise ConfigError(f"remat.custom.{tag}: unknown tag; valid tags: {', '.join(TAGS)}")
        if action not in ACTIONS:
            raise ConfigError(f"remat.custom.{tag}={action}: the action must be one of {', '.join(ACTIONS)}")
    if remat.custom and remat.policy == "none":
        raise ConfigError("remat.custom refines a recomputation policy; set remat.policy to one of "
                          f"{', '.join(p for p in POLICIES if p != 'none')} (e.g. full: recompute all but your tags)")
    if remat.every_n_layers < 1 or n_layers % remat.every_n_layers:
        raise ConfigError(f"remat.every_n_layers ({remat.every_n_layers}) must be a positive divisor of "
                          f"model.n_layers ({n_layers})")


def actions(remat: RematConfig) -> dict[str, str] | None:
    """tag -> action for this config (None: no recomputation at all)."""
    base = POLICIES[remat.policy]
    if base is None:
        return None
    return {tag: "recompute" for tag in TAGS} | base | dict(remat.custom)


def host_offload_supported() -> bool:
    """Whether the default device has a pinned host memory space to offload into.

    A CPU lists one too, but it is the same RAM as the "device", so offloading would only add
    copies: on CPU offloaded tags are saved instead.
    """
    device = jax.devices()[0]
    return device.platform != "cpu" and any(m.kind == "pinned_host" for m in device.addressable_memories())


def checkpoint_policy(remat: RematConfig, offload: bool | None = None) -> Callable | None:
    """The jax.checkpoint policy for a config, or None when layers are not rematerialised.

    Without a pinned host memory space, offloaded tags are saved on the device instead.
    """
    chosen = actions(remat)
    if chosen is None:
        return None
    offload = host_offload_supported() if offload is None else offload
    saved = [t for t, a in chosen.items() if a == "save" or (a == "offload" and not offload)]
    offloaded = [t for t, a in chosen.items() if a == "offload" and offload]
    if offloaded:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=saved, names_which_can_be_offloaded=offloaded,
            offload_src="device", offload_dst="pinned_host")
    return jax.checkpoint_policies.save_only_these_names(*saved)


def describe(remat: RematConfig) -> str:
    """One line for the log: what is kept where, and whether offloading fell back to saving."""
    chosen = actions(remat)
    if chosen is None:
        return "remat none: every activation is kept"
    by_action = {a: [t for t, x in chosen.items() if x == a] for a in ACTIONS}
    line = (f"remat {remat.policy}{' (custom)' if remat.custom else ''}"
            f"{f' on one layer in {remat.every_n_layers}' if remat.every_n_layers > 1 else ''}: "
            f"save {', '.join(by_action['save']) or 'layer input only'}")
    if by_action["offload"]:
        line += f"; offload {', '.join(by_action['offload'])}"
        if not host_offload_supported():
            line += f" (no pinned host memory on {jax.devices()[0].platform}: kept on the device instead)"
    return line
