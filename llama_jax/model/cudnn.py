"""cuDNN's fused flash attention for packed documents, with no [T, T] mask anywhere.

jax.nn.dot_product_attention takes packed documents only as a dense [batch, 1, T, T] mask, which it
turns into a bias that cuDNN reads once per head (192 MiB per 8K sequence, growing as T²). cuDNN
itself takes a packed ("ragged") layout instead: per row the length and offset of each document,
and it applies the causal mask inside each one. jax exposes that layout only in its private module
jax._src.cudnn.fused_attention_stablehlo (q_seqlen / q_offsets; Hopper or newer and cuDNN 9.6+),
which this file uses (imported by jax_workarounds.py, the one module that reaches into jax's private modules);
its keyword interface is the same from jax 0.10.2 to 0.12. Where the packed
layout is missing (an A100, an older cuDNN), packed batches run the blocked kernel (flash.py).

The number of documents per row must be static (cuDNN keeps softmax statistics per document:
[batch x max_segments, heads, T] fp32), so rows are laid out for `max_segments` documents and a
batch with more documents in some row runs an exact XLA fallback for that call instead
(query_chunked_attention: slower, little memory): exact in every case, fast in the common one. A
batch of one document per row runs plain causal cuDNN.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from llama_jax.model.context_parallel import XLA_KERNEL, PaddedKernel
from llama_jax.model.flash import block_size, blocked_attention
from llama_jax.model.jax_workarounds import jax_cudnn as cudnn

# The name of the conditional that picks a kernel by the documents in a row, in the compiled program: its first
# branch is one document per row (what bench/step.py and gpu-check time), the others rarer layouts. `plan`'s step
# prediction prices the first (hlo.analyze's branch_runs); every branch still compiles and counts for memory.
KERNEL_CHOICE_SCOPE = "cudnn_kernel_by_documents"


def segment_layout(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[b, t] segment ids (each document a contiguous run) -> cuDNN's packed layout.

    Returns (lengths [b, max_segments], offsets [b, max_segments + 1], documents per row [b]); the
    entries past a row's last document are -1, as cuDNN expects. Trailing padding (segment 0) is a
    document of its own: it attends only to itself and its outputs are never a target.
    """
    b, _ = segment_ids.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    index = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # which document of its row each token is in
    documents = index[:, -1] + 1
    lengths = jnp.zeros((b, max_segments), jnp.int32).at[jnp.arange(b)[:, None], index].add(1, mode="drop")
    offsets = jnp.cumsum(lengths, axis=1, dtype=jnp.int32) - lengths
    present = jnp.arange(max_segments) < documents[:, None]
    lengths, offsets = jnp.where(present, lengths, -1), jnp.where(present, offsets, -1)
    return lengths, jnp.pad(offsets, ((0, 0), (0, 1)), constant_values=-1), documents


def cudnn_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, max_segments: int
) -> jax.Array:
    """Causal attention within documents, q [b,t,n,h], k/v [b,t,kv,h] -> [b,t,n,h], on cuDNN."""
    options = {"scale": q.shape[-1] ** -0.5, "qkv_layout": "BTNH"}

    def one_document_per_row(q, k, v):
        return cudnn.dot_product_attention(q, k, v, mask_type=cudnn.MaskType.CAUSAL, **options)

    if segment_ids is None:
        return one_document_per_row(q, k, v)
    lengths, offsets, documents = segment_layout(segment_ids, max_segments)

    def packed(q, k, v):
        return cudnn.dot_product_attention(
            q,
            k,
            v,
            q_seqlen=lengths,
            kv_seqlen=lengths,
            q_offsets=offsets,
            kv_offsets=offsets,
            mask_type=cudnn.MaskType.PADDING_CAUSAL,
            **options,
        )

    def too_many_documents(q, k, v):
        return query_chunked_attention(q, k, v, segment_ids)

    most = jnp.max(documents)
    if not packed_layout_supported():

        def blocked(q, k, v):
            if block_size(q.shape[1]):
                return blocked_attention(q, k, v, segment_ids)
            return query_chunked_attention(q, k, v, segment_ids)

        kernels, branch = [one_document_per_row, blocked], (most > 1).astype(jnp.int32)
    else:
        kernels = [one_document_per_row, packed, too_many_documents]
        branch = jnp.where(most <= 1, 0, jnp.where(most <= max_segments, 1, 2))
    with jax.named_scope(KERNEL_CHOICE_SCOPE):
        return jax.lax.switch(branch, kernels, q, k, v)


def query_chunked_attention(q, k, v, segment_ids, chunk: int = 256) -> jax.Array:
    """Exact causal document attention in XLA, `chunk` queries at a time against every key, each chunk
    recomputed in the backward pass: [chunk, T] scores at a time, never [T, T]. The rare batch with more
    documents in a row than cuDNN's layout holds runs this (it does the masked half too; memory, not
    speed, is what matters for a fallback compiled into every step)."""
    t = q.shape[1]
    chunk = chunk if t % chunk == 0 else t
    keys = jnp.arange(t)

    @jax.checkpoint
    def one_chunk(start):
        queries = start + jnp.arange(chunk)
        q_chunk = jax.lax.dynamic_slice_in_dim(q, start, chunk, axis=1)
        q_segments = jax.lax.dynamic_slice_in_dim(segment_ids, start, chunk, axis=1)
        mask = (q_segments[:, :, None] == segment_ids[:, None, :]) & (queries[:, None] >= keys[None, :])
        return jax.nn.dot_product_attention(q_chunk, k, v, mask=mask[:, None], implementation="xla")

    out = jax.lax.map(one_chunk, jnp.arange(0, t, chunk))  # [chunks, b, chunk, n, h]
    return jnp.moveaxis(out, 0, 1).reshape(q.shape)


def packed_layout_supported() -> bool:
    """cuDNN's packed layout needs a Hopper or newer GPU and cuDNN 9.6+ (jax checks both when tracing)."""
    try:
        return cudnn.check_compute_capability("9.0") and cudnn.check_cudnn_version() >= 90600
    except RuntimeError:  # no cuDNN
        return False


# ---------------------------------------------------------------------------------------------
# Padded attention with the softmax statistics, for context parallelism (context_parallel.py)
#
# Combining partial attentions needs two things jax's public cuDNN call does not give: each part's
# log-sum-exp (the private call returns cuDNN's softmax statistics with return_residual=True: [b, n, t]
# fp32, the natural log of the sum of exp(scale * q.k)) and a backward pass that starts from the
# *combined* output and log-sum-exp instead of the part's own (FlashAttention's backward of a split
# softmax; the private call's own backward ignores any gradient of the statistics). The backward is
# the private primitive jax's own backward binds; its operands are the same from jax 0.10.2 to 0.12,
# where it gained a `score_mod` parameter (None: plain attention).


def _padded_options(q, causal):
    mask_type = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
    return mask_type, q.shape[-1] ** -0.5


def _padded_forward(q, k, v, q_len, kv_len, causal):
    mask_type, scale = _padded_options(q, causal)
    out, lse = cudnn.dot_product_attention(
        q,
        k,
        v,
        q_seqlen=q_len.astype(jnp.int32),
        kv_seqlen=kv_len.astype(jnp.int32),
        mask_type=mask_type,
        scale=scale,
        qkv_layout="BTNH",
        return_residual=True,
    )
    return out, lse


def _padded_backward(q, k, v, q_len, kv_len, causal, out, lse, d_out):
    mask_type, scale = _padded_options(q, causal)
    unused = jnp.zeros(0, q.dtype)  # bias, offsets and page tables, as jax passes them
    params = dict(
        scale=scale,
        seed=42,
        dropout_rate=0.0,
        variadic_args=(False, False),
        mask_type=mask_type,
        layout=cudnn.AttentionLayout.BTNH.value,
        sliding_window_length=None,
    )
    if _BACKWARD_TAKES_SCORE_MOD:
        params["score_mod"] = None
    grads = cudnn._dot_product_attention_bwd_p_wrapper.bind(
        q,
        k,
        v,
        unused,
        q_len.astype(jnp.int32),
        kv_len.astype(jnp.int32),
        unused,
        unused,
        unused,
        unused,
        lse,
        out.astype(q.dtype),
        d_out.astype(q.dtype),
        **params,
    )
    return tuple(grads[:3])


def _private_backward_known() -> tuple[bool, bool]:
    """(the private backward is there as this file calls it, it takes score_mod)."""
    rule = getattr(cudnn, "_dot_product_attention_bwd_rule", None)
    if rule is None or not hasattr(cudnn, "_dot_product_attention_bwd_p_wrapper"):
        return False, False
    names = inspect.signature(rule).parameters
    return "return_residual" in names, "score_mod" in names


_BACKWARD_KNOWN, _BACKWARD_TAKES_SCORE_MOD = _private_backward_known()

# On a jax whose private cuDNN module no longer matches, the XLA kernel keeps context parallelism exact.
PADDED_KERNEL = PaddedKernel(_padded_forward, _padded_backward) if _BACKWARD_KNOWN else XLA_KERNEL
