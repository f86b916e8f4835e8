"""The projections' matmul, and on CPU a backward pass that XLA:CPU runs fast.

A projection contracts the trailing axes of x [..., in] with the leading axes of its kernel
[in..., out...]. Its weight gradient, x^T @ dy, contracts over the batch and sequence axes, the
outer axes of both operands. XLA:CPU's matmul wants the contracted axis innermost in its first
operand, and left to itself it transposes the output gradient dy (for the MLP, three times wider
than x) inside a slow fused loop: the largest cost of a CPU train step after the matmuls
(bench/step.py's profile). On CPU we therefore write the backward pass ourselves: the narrower of x
and dy is transposed once, explicitly (an optimization barrier keeps XLA from folding the transpose
back into the matmul), and the other is used as it is. For the MLP's down projection that is dy: its
x, the SwiGLU product, is recomputed in the backward pass from the saved gate and up, and XLA:CPU fuses
that recomputation, reading the layers' saved stack, into the transpose: 63 ms a layer in the `bench`
preset's profile, against 6 ms for the same transpose of operands just computed.
On GPUs and TPUs the plain einsum is kept: their matmul libraries take transposed operands for free.

model.fp8=tensorwise: the projections' matmuls take fp8 operands with per-tensor current scaling (scale =
amax / the format's largest value, computed from the tensor itself each step, so there is no scaling state):
x and the kernel in e4m3 (3 mantissa bits) forward, the output gradient in e5m2 (the range gradients need),
products accumulated in fp32, rescaled, and written in the compute dtype (_scaled_dot). The backward pass keeps
the fp8 operands, not bf16 copies. Written by hand (a custom_vjp) rather than with Flax's fp8_ops (delayed scaling
only, its amax history carried as params in a gradient-overwriting collection, bf16 operands kept for the
backward), Qwix (intercepts the calls of wrapped modules: our pipeline and remat paths apply Block outside the
wrapped model) or Transformer Engine (CUDA only: nothing of it runs or lowers on CPU). XLA:GPU rewrites each
scaled dot into cuBLASLt's fp8 GEMM (`__cublas$lt$matmul$f8`, tests/test_gpu_target.py), scales and output type
included.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

FP8_FORWARD = jnp.float8_e4m3fn  # activations and weights
FP8_GRADIENT = jnp.float8_e5m2  # output gradients: two more exponent bits, one less mantissa bit


def contracted_axes(spec: str) -> int:
    """How many of x's trailing axes a projection spec ("btd,dnh->btnh") contracts with the kernel's leading ones."""
    x_axes, outputs = spec.split("->")[0].split(",")[0], spec.split("->")[1]
    return len(set(x_axes) - set(outputs))


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(x / scale in `dtype`, scale): scale = amax(|x|) / dtype's largest finite value, an fp32 scalar. A
    non-finite amax gives NaN everywhere, which the NaN guard sees."""
    largest = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / largest, jnp.float32(1))
    # The clip: x / scale may round one ulp past the largest value, which e4m3fn (no infinity) makes NaN.
    return jnp.clip(x.astype(jnp.float32) / scale, -largest, largest).astype(dtype), scale


def quantized_input(x: jax.Array, tag: str) -> tuple[jax.Array, jax.Array]:
    """x quantized once for the projections that read it (q, k, v; gate, up), named by x's remat tag: a policy
    that saves the tag keeps these fp8 operands for the backward pass, not copies in the compute dtype. Named as
    raw bytes: a float8 value saved by name under jax.checkpoint comes back as NaN on XLA:CPU (jax 0.10), its
    bits pass through; the bitcasts cost nothing."""
    x8, scale = quantize(x, FP8_FORWARD)
    bits = checkpoint_name(jax.lax.bitcast_convert_type(x8, jnp.uint8), tag)
    return jax.lax.bitcast_convert_type(bits, FP8_FORWARD), checkpoint_name(scale, tag)


def _scaled_dot(a, b, axes, scale, dtype):
    # The product comes out in `dtype` and is scaled there: XLA:GPU folds that scale into cuBLASLt's fp8 GEMM, which
    # writes `dtype` at once (it still accumulates in fp32). An fp32 product scaled and cast after is a GEMM writing
    # fp32 and a pass reading it back to write `dtype`: 8 more bytes an element, 4.5% of the fp8 layer's time in
    # plan's H200 prediction (docs/performance.md).
    return jax.lax.dot_general(a, b, (axes, ((), ())), preferred_element_type=dtype) * scale.astype(dtype)


def fp8_project(spec: str, x: jax.Array, kernel: jax.Array, x_fp8: tuple[jax.Array, jax.Array] | None = None):
    """jnp.einsum(spec, x, kernel) with fp8 operands (model.fp8=tensorwise). x_fp8: x already quantized
    (quantize(x, FP8_FORWARD)), for projections that share an input and a remat tag (q, k, v; gate, up)."""
    x8, x_scale = quantize(x, FP8_FORWARD) if x_fp8 is None else x_fp8
    return _fp8_project(x, jax.lax.stop_gradient(x8), jax.lax.stop_gradient(x_scale), kernel, contracted_axes(spec))


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fp8_project(x, x8, x_scale, kernel, contracted):
    return _fp8_project_forward(x, x8, x_scale, kernel, contracted)[0]


def _fp8_project_forward(x, x8, x_scale, kernel, contracted):
    k8, k_scale = quantize(kernel, FP8_FORWARD)
    axes = (tuple(range(x.ndim - contracted, x.ndim)), tuple(range(contracted)))
    return _scaled_dot(x8, k8, axes, x_scale * k_scale, x.dtype), (x8, x_scale, k8, k_scale)


def _fp8_project_backward(contracted, residuals, dy):
    x8, x_scale, k8, k_scale = residuals
    dy8, dy_scale = quantize(dy, FP8_GRADIENT)
    tokens = x8.ndim - contracted
    dx = _scaled_dot(
        dy8, k8, (tuple(range(tokens, dy.ndim)), tuple(range(contracted, k8.ndim))), dy_scale * k_scale, dy.dtype
    )
    dkernel = _scaled_dot(x8, dy8, (tuple(range(tokens)), tuple(range(tokens))), x_scale * dy_scale, dy.dtype)
    return dx, None, None, dkernel


_fp8_project.defvjp(_fp8_project_forward, _fp8_project_backward)


def uses_cpu_backward(platform: str, enabled: bool = True) -> bool:
    """Whether projections use the CPU backward pass (model.cpu_projection; other platforms keep einsum's):
    what the model passes project() for the platform of its trace (TraceContext.platform)."""
    return enabled and platform == "cpu"


def project(spec: str, x: jax.Array, kernel: jax.Array, cpu_backward: bool = True) -> jax.Array:
    """jnp.einsum(spec, x, kernel) for specs like "btd,dnh->btnh": x's trailing axes contract with the
    kernel's leading ones; with cpu_backward (uses_cpu_backward), its backward pass is the one for CPUs."""
    if not cpu_backward:
        return jnp.einsum(spec, x, kernel)
    return _project(x, kernel, contracted_axes(spec))


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

    def tokens_last(a):  # [features..., batch, seq]: the narrow operand, moved once; the barrier keeps it moved
        return jax.lax.optimization_barrier(jnp.moveaxis(a, list(range(tokens)), list(range(-tokens, 0))))

    if math.prod(x.shape[tokens:]) <= math.prod(dy.shape[tokens:]):
        return dx, jnp.tensordot(tokens_last(x), dy, tokens)
    # dy is the narrower (the MLP's down projection): move it, and the weight-sized product after.
    outs = dy.ndim - tokens
    return dx, jnp.moveaxis(jnp.tensordot(tokens_last(dy), x, tokens), list(range(outs)), list(range(-outs, 0)))


_project.defvjp(_project_forward, _project_backward)
