"""RMSNorm's function: x / rms(x) * scale in fp32, with a backward pass that keeps only its input."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: jnp.dtype) -> jax.Array:
    """x / rms(x) * scale, in fp32 (the mean of squares overflows/underflows in 16-bit), cast to dtype.

    A custom backward pass: autodiff of the formula would keep fp32 copies of the activation; this
    keeps only the input x (bf16 on GPU) and recomputes the cheap normalisation from it.
    """
    return _rms_norm_forward(x, scale, eps, dtype)[0]


def _normalized(x, eps):
    x32 = x.astype(jnp.float32)
    inverse_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32 * inverse_rms, inverse_rms


def _rms_norm_forward(x, scale, eps, dtype):
    return (_normalized(x, eps)[0] * scale.astype(jnp.float32)).astype(dtype), (x, scale)


def _rms_norm_backward(eps, dtype, residuals, d_out):
    x, scale = residuals
    normed, inverse_rms = _normalized(x, eps)  # recomputed: cheaper than keeping fp32 copies
    d_normed = d_out.astype(jnp.float32) * scale.astype(jnp.float32)
    # d/dx of x * r(x), r = 1/rms: r * (g - normed * mean(g * normed))
    d_x = inverse_rms * (d_normed - normed * jnp.mean(d_normed * normed, axis=-1, keepdims=True))
    d_scale = jnp.sum(d_out.astype(jnp.float32) * normed, axis=tuple(range(x.ndim - 1)))
    return d_x.astype(x.dtype), d_scale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_forward, _rms_norm_backward)
