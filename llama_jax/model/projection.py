"""The projections' matmul, and on CPU a backward pass that XLA:CPU runs fast.

A projection contracts the trailing axes of x [..., in] with the leading axes of its kernel
[in..., out...]. Its weight gradient, x^T @ dy, contracts over the batch and sequence axes, the
outer axes of both operands. XLA:CPU's matmul wants the contracted axis innermost in its first
operand, and left to itself it transposes the output gradient dy (for the MLP, three times wider
than x) inside a slow fused loop: the largest cost of a CPU train step after the matmuls
(bench/step.py's profile). On CPU we therefore write the backward pass ourselves: x is transposed
once, explicitly (an optimization barrier keeps XLA from folding the transpose back into the
matmul), and dy is used as it is. On GPUs and TPUs the plain einsum is kept: their matmul libraries
take transposed operands for free.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from llama_jax.model import platform


def uses_cpu_backward(platform: str, enabled: bool = True) -> bool:
    """Whether projections use the CPU backward pass (model.cpu_projection; other platforms keep einsum's)."""
    return enabled and platform == "cpu"


def project(spec: str, x: jax.Array, kernel: jax.Array, cpu_backward: bool = True) -> jax.Array:
    """jnp.einsum(spec, x, kernel) for specs like "btd,dnh->btnh": x's trailing axes contract with the
    kernel's leading ones."""
    if not uses_cpu_backward(platform.backend(), cpu_backward):
        return jnp.einsum(spec, x, kernel)
    x_axes, outputs = spec.split("->")[0].split(",")[0], spec.split("->")[1]
    return _project(x, kernel, len(set(x_axes) - set(outputs)))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _project(x: jax.Array, kernel: jax.Array, contracted: int) -> jax.Array:
    # No reshapes: merging a sharded axis into another (tokens sharded over `sequence`, say) would
    # make the SPMD partitioner gather it.
    return jnp.tensordot(x, kernel, contracted)


def _project_forward(x, kernel, contracted):
    return _project(x, kernel, contracted), (x, kernel)


def _project_backward(contracted, residuals, dy):
    x, kernel = residuals
    tokens = x.ndim - contracted  # the leading (batch, sequence) axes
    out_axes = list(range(tokens, dy.ndim))
    dx = jnp.tensordot(dy, kernel, (out_axes, list(range(contracted, kernel.ndim))))
    # [in..., batch, seq]: the narrow operand is the one moved, once, and the barrier keeps it moved.
    x_moved = jax.lax.optimization_barrier(jnp.moveaxis(x, list(range(tokens)), list(range(-tokens, 0))))
    dkernel = jnp.tensordot(x_moved, dy, (list(range(contracted, x.ndim)), list(range(tokens))))
    return dx, dkernel


_project.defvjp(_project_forward, _project_backward)
