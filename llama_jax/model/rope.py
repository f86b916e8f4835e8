"""Rotary position embeddings as Llama 3 uses them: its rescaled rotation speeds (the context extension), the
angles of the positions, and the rotation of query and key heads (Hugging Face's "rotate_half" layout)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.config import ModelConfig


def rope_inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[head_dim / 2] rotation speeds, rescaled the way Llama 3 extends its context.

    Llama 3 leaves the fast-rotating (short-wavelength) dimensions alone, divides the slow ones by
    `factor`, and interpolates smoothly in between, with the boundaries set by how many wavelengths
    fit into the original training context.
    """
    head_dim = cfg.resolved_head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factor = cfg.rope_scaling_factor
    if factor == 1.0:
        return inv_freq.astype(np.float32)
    wavelength = 2 * math.pi / inv_freq
    # How many times each wavelength fits into the original context, mapped to [0, 1] between the
    # low- and high-frequency boundaries: 0 = scale fully, 1 = leave unchanged.
    periods_in_context = cfg.rope_original_max_len / wavelength
    blend = np.clip(
        (periods_in_context - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor),
        0.0,
        1.0,
    )
    scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
    return scaled.astype(np.float32)


def rope_angles(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """positions [batch, seq] -> (cos, sin), each [batch, seq, 1, head_dim / 2], in fp32."""
    angles = positions.astype(jnp.float32)[..., None] * rope_inverse_frequencies(cfg)
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (x[i], x[i + head_dim/2]) — the Hugging Face "rotate_half" layout."""
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
