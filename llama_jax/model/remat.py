"""Activation recomputation policies: each named policy says, tensor by tensor, what the backward
pass gets from the forward pass.

The model tags its activations with ``checkpoint_name`` (the names in config/choices.py's REMAT_TAGS). For each
tag a policy (REMAT_POLICIES there, refined by remat.custom) chooses one action:
    save       keep it in device memory
    offload    move it to pinned host memory during the forward, bring it back for the backward
    recompute  drop it and recompute it from the layer input (which the layer scan always keeps)
Untagged intermediates (attention scores, softmax, rotary, ...) are always recomputed.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from llama_jax.config import RematConfig
from llama_jax.config.choices import REMAT_ACTIONS, REMAT_POLICIES, REMAT_TAGS


def actions(remat: RematConfig) -> dict[str, str] | None:
    """tag -> action for this config (None: no recomputation at all)."""
    base = REMAT_POLICIES[remat.policy]
    if base is None:
        return None
    return {tag: "recompute" for tag in REMAT_TAGS} | base | dict(remat.custom)


def host_offload_supported() -> bool:
    """Whether this process's devices have a pinned host memory space to offload into.

    A CPU lists one too, but it is the same RAM as the "device", so offloading would only add
    copies: on CPU offloaded tags are saved instead.
    """
    device = jax.local_devices()[0]  # this process's: jax.devices()[0] belongs to process 0
    return device.platform != "cpu" and any(m.kind == "pinned_host" for m in device.addressable_memories())


def placement(remat: RematConfig, offload: bool | None = None) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(tags kept on the device, tags offloaded to pinned host memory) as this device runs the config, or
    None when layers are not rematerialised. Without a pinned host memory space offloaded tags are saved
    on the device instead, so two policies may run alike."""
    chosen = actions(remat)
    if chosen is None:
        return None
    offload = host_offload_supported() if offload is None else offload
    saved = tuple(t for t, a in chosen.items() if a == "save" or (a == "offload" and not offload))
    return saved, tuple(t for t, a in chosen.items() if a == "offload" and offload)


def checkpoint_policy(remat: RematConfig, offload: bool | None = None) -> Callable | None:
    """The jax.checkpoint policy for a config, or None when layers are not rematerialised."""
    placed = placement(remat, offload)
    if placed is None:
        return None
    saved, offloaded = placed
    if offloaded:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=saved,
            names_which_can_be_offloaded=offloaded,
            offload_src="device",
            offload_dst="pinned_host",
        )
    return jax.checkpoint_policies.save_only_these_names(*saved)


def describe(remat: RematConfig) -> str:
    """One line for the log: what is kept where, and whether offloading fell back to saving."""
    chosen = actions(remat)
    if chosen is None:
        return "remat none: every activation is kept"
    by_action = {a: [t for t, x in chosen.items() if x == a] for a in REMAT_ACTIONS}
    line = (
        f"remat {remat.policy}{' (custom)' if remat.custom else ''}"
        f"{f' on one layer in {remat.every_n_layers}' if remat.every_n_layers > 1 else ''}: "
        f"save {', '.join(by_action['save']) or 'layer input only'}"
    )
    if by_action["offload"]:
        line += f"; offload {', '.join(by_action['offload'])}"
        if not host_offload_supported():
            line += f" (no pinned host memory on {jax.local_devices()[0].platform}: kept on the device instead)"
    return line
