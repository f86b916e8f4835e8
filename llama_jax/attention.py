"""Attention cores: which implementation runs, and the document/causal mask it applies.

The model calls :func:`attention` with rotated queries/keys in [batch, seq, heads, head_dim] layout.
``jax.nn.dot_product_attention`` handles grouped-query attention itself (query heads a multiple of
key/value heads) and has two backends: cuDNN's fused flash attention on NVIDIA GPUs and a plain XLA
implementation everywhere else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def select_implementation(requested: str, platform: str, dtype, head_dim: int) -> str:
    """Pick 'cudnn' or 'xla'.

    'auto' picks cuDNN only where it can run: a GPU, a 16-bit dtype and a head_dim that is a
    multiple of 8 and at most 256 (cuDNN's limits). Asking for 'cudnn' where it cannot run is an
    error rather than a silent fallback, so a benchmark never measures the wrong kernel.
    """
    cudnn_ok = platform == "gpu" and jnp.dtype(dtype) in map(jnp.dtype, CUDNN_DTYPES) \
        and head_dim % 8 == 0 and head_dim <= 256
    if requested == "auto":
        return "cudnn" if cudnn_ok else "xla"
    if requested == "cudnn" and not cudnn_ok:
        raise ValueError(
            f"model.attention=cudnn needs a GPU, bfloat16/float16 compute and head_dim a multiple of 8 "
            f"<= 256 (have platform {platform}, dtype {jnp.dtype(dtype).name}, head_dim {head_dim}); "
            "use model.attention=auto"
        )
    return requested


def document_mask(segment_ids: jax.Array) -> jax.Array:
    """[batch, seq] segment ids -> [batch, 1, seq, seq] mask: a query sees keys of its own document.

    Causality is applied by the kernel (is_causal=True); together they stop packed documents from
    attending to each other.
    """
    return (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
              implementation: str) -> jax.Array:
    """Causal attention with document masking. q [b,t,n,h], k/v [b,t,kv,h] -> [b,t,n,h]."""
    mask = None if segment_ids is None else document_mask(segment_ids)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)
