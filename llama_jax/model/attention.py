"""Attention cores: which implementation runs, the causal/document mask, and context parallelism.

The model calls :func:`attention` with rotated queries/keys in [batch, seq, heads, head_dim] layout.
``jax.nn.dot_product_attention`` handles grouped-query attention itself (query head i reads kv head
i // (heads / kv_heads)) and has two backends: cuDNN's fused flash attention on NVIDIA GPUs and a
plain XLA implementation everywhere else.

Packed documents: the blocked kernel (flash.py) and cuDNN's packed layout (cudnn.py) take segment ids
as they are; only XLA's kernel gets a dense document mask.

Context parallelism: when the trace's mesh (TraceContext, context.py) splits the sequence over its `sequence`
axis, each device holds a slice of the queries and all-gathers the keys and values of the whole sequence (the
scheme Llama 3 used for its 128K context); context_parallel.py computes, per chunk of queries, the causal
block on its own keys and the visible prefix of earlier chunks, skipping later ones, with cuDNN on GPUs (no
mask tensor) and XLA elsewhere. It needs to know how the sequence is laid out over the devices
(`balanced`: sharding.balance_sequence's pairing of early and late chunks, mesh.load_balance).

More tensor shards than kv heads (Llama 3 70B/405B at tensor=16 have 8 kv heads): the kv heads are
replicated while the query heads are split, and attention runs inside a shard_map in which each
device takes the kv head of its own query group, on every implementation (jax's cuDNN partitioner
would reject q and k/v sharded differently).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from llama_jax.errors import ConfigError
from llama_jax.model.context import TraceContext
from llama_jax.model.context_parallel import SEQUENCE_AXIS, XLA_KERNEL, sequence_sharded_attention
from llama_jax.model.cudnn import PADDED_KERNEL, cudnn_attention
from llama_jax.model.flash import MIN_SEQ, block_size, blocked_attention

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def select_implementation(
    requested: str, platform: str, dtype, head_dim: int, seq_len: int | None = None, strict: bool = True
) -> str:
    """Pick 'cudnn', 'blocked' (flash.py, plain JAX) or 'xla'.

    'auto' picks cuDNN where it can run: a GPU, a 16-bit dtype and a head_dim that is a multiple of
    8 and at most 256 (cuDNN's limits); otherwise, on CPUs and GPUs, the blocked kernel when the
    sequence splits into blocks (seq_len None: assume it does); otherwise XLA's. Asking for a kernel where it cannot run
    is an error rather than a silent fallback, so a benchmark never measures the wrong kernel.
    """
    cudnn_ok = (
        platform == "gpu" and jnp.dtype(dtype) in map(jnp.dtype, CUDNN_DTYPES) and head_dim % 8 == 0 and head_dim <= 256
    )
    blocked_ok = platform in ("cpu", "gpu") and (seq_len is None or block_size(seq_len) is not None)
    if requested == "auto":
        return "cudnn" if cudnn_ok else "blocked" if blocked_ok else "xla"
    if requested == "cudnn" and not cudnn_ok:
        raise ConfigError(
            f"model.attention=cudnn needs a GPU, bfloat16/float16 compute and head_dim a multiple of 8 "
            f"<= 256 (have platform {platform}, dtype {jnp.dtype(dtype).name}, head_dim {head_dim}); "
            "use model.attention=auto"
        )
    if requested == "blocked" and not blocked_ok:
        if not strict:  # an input shorter than training's (init's dummy batch, a prompt): XLA's kernel
            return "xla"
        raise ConfigError(
            f"model.attention=blocked needs a CPU or GPU and train.seq_len >= {MIN_SEQ} divisible "
            f"by its block length (have platform {platform}, seq_len {seq_len}); "
            "use model.attention=auto"
        )
    return requested


def skips_masked_blocks(implementation: str) -> bool:
    """Whether the kernel skips the causal mask's future half (model FLOPs then count half of it)."""
    return implementation in ("cudnn", "blocked")


def document_mask(q_segments: jax.Array, k_segments: jax.Array) -> jax.Array:
    """[batch, q], [batch, k] segment ids -> [batch, 1, q, k]: a query sees only its own document."""
    return q_segments[:, None, :, None] == k_segments[:, None, None, :]


def _in_manual_region(context: TraceContext) -> bool:
    """Whether some mesh axes are manual here (a pipeline stage's shard_map over `pipeline`): jax's cuDNN
    partitioner fails on the rest of the mesh there (it reads a partition spec that a sharding inside a manual
    region does not have), so cuDNN then runs inside a shard_map over the other axes too."""
    return bool(context.manual_axes)


def _query_heads_split_from_kv_heads(context: TraceContext) -> bool:
    """Whether the query heads are split over devices that the kv heads are replicated on."""
    q_axes, kv_axes = context.mesh_axes(("act_heads", "act_kv_heads"))
    return q_axes != kv_axes and context.axis_size(q_axes) > 1


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    implementation: str,
    max_segments: int = 16,
    balanced: bool = True,
    *,
    context: TraceContext,
) -> jax.Array:
    """Causal attention with document masking. q [b,t,n,h], k/v [b,t,kv,h] -> [b,t,n,h].

    balanced: under context parallelism, whether the sequence is laid out by sharding.balance_sequence.
    context: the trace's mesh and rules, which say whether attention runs per device in a shard_map."""
    if (
        context.axis_size(SEQUENCE_AXIS) > 1
        or _query_heads_split_from_kv_heads(context)
        or (implementation == "cudnn" and _in_manual_region(context))
    ):
        return _per_device(q, k, v, segment_ids, implementation, max_segments, balanced, context)
    return _tokens_in_order(q, k, v, segment_ids, implementation, max_segments)


def _tokens_in_order(q, k, v, segment_ids, implementation, max_segments):
    if implementation == "blocked":
        return _keeping_residuals(blocked_attention)(q, k, v, segment_ids)
    if implementation == "cudnn":
        return _keeping_residuals(lambda q, k, v, s: cudnn_attention(q, k, v, s, max_segments))(q, k, v, segment_ids)
    # The tokens are in order: the kernel's own causal mask applies and only the document
    # boundaries need an explicit mask.
    mask = None if segment_ids is None else document_mask(segment_ids, segment_ids)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)


def _keeping_residuals(kernel):
    """A flash kernel whose backward-pass residuals (its inputs, output and per-query softmax
    statistics: O(T) memory) carry the tag "attention_context", so a remat policy that keeps the
    attention's output keeps them too and never re-runs the kernel's forward pass."""

    @jax.custom_vjp
    def run(q, k, v, segment_ids):
        return kernel(q, k, v, segment_ids)

    def forward(q, k, v, segment_ids):
        out, backward = jax.vjp(lambda q, k, v: kernel(q, k, v, segment_ids), q, k, v)
        return out, jax.tree.map(lambda r: checkpoint_name(r, "attention_context"), backward)

    def backward(residuals, d_out):
        return (*residuals(d_out), None)

    run.defvjp(forward, backward)
    return run


def cached_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array) -> jax.Array:
    """Decoding: queries at `positions` [b, t] attend to the cache slots at or before them.

    Slot i holds the token at position i; slots after a query's position are future tokens or not
    yet written, and are masked. Decoding is bound by reading the cache, not by FLOPs, so JAX picks
    the kernel (implementation=None: cuDNN where it applies, else XLA).
    """
    slots = jnp.arange(k_cache.shape[1])
    mask = positions[:, None, :, None] >= slots[None, None, None, :]
    return jax.nn.dot_product_attention(q, k_cache, v_cache, mask=mask, implementation=None)


def _per_device(q, k, v, segment_ids, implementation, max_segments, balanced, context: TraceContext):
    """Attention inside a shard_map: for context parallelism, or for more tensor shards than kv heads."""
    if segment_ids is None:
        segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    # The partition specs follow the trace's logical-axis rules, so an expert's table override
    # moves this shard_map along with everything else.
    heads = context.mesh_axes(("batch", "seq", "act_heads", "head_dim"))
    kv_heads = context.mesh_axes(("batch", "seq", "act_kv_heads", "head_dim"))
    tokens = context.mesh_axes(("batch", "seq"))
    shards = context.axis_size(SEQUENCE_AXIS)

    def local(q, k, v, segments):
        k, v = _own_kv_heads(q, k, v, heads[2], kv_heads[2])
        if shards == 1:
            return _tokens_in_order(q, k, v, segments, implementation, max_segments)
        return context_parallel_attention(q, k, v, segments, implementation, max_segments, shards, balanced)

    return jax.shard_map(
        local, mesh=context.shard_map_mesh, in_specs=(heads, kv_heads, kv_heads, tokens), out_specs=heads
    )(q, k, v, segment_ids)


def context_parallel_attention(
    q, k, v, segments, implementation: str, max_segments: int, shards: int, balanced: bool
) -> jax.Array:
    """One device's share of context-parallel attention, inside a shard_map over the `sequence` axis of
    `shards` devices: q [b, t, n, h], k/v [b, t, kv, h], segments [b, t] -> [b, t, n, h]."""
    in_chunk, kernel = context_parallel_kernels(implementation, max_segments, q.shape[1] // (2 if balanced else 1))
    return sequence_sharded_attention(q, k, v, segments, shards, balanced, in_chunk, kernel)


def context_parallel_kernels(implementation: str, max_segments: int, chunk: int):
    """(the in-order kernel for a chunk's own block, the padded kernel for partial attentions)."""
    # The blocked kernel runs a chunk's own block only where the chunk splits into blocks.
    in_chunk_kernel = "xla" if implementation == "blocked" and block_size(chunk) is None else implementation
    in_chunk = lambda q, k, v, s: _tokens_in_order(q, k, v, s, in_chunk_kernel, max_segments)  # noqa: E731
    return in_chunk, PADDED_KERNEL if implementation == "cudnn" else XLA_KERNEL


def _own_kv_heads(q, k, v, q_axes, kv_axes):
    """Inside the shard_map: the kv heads this device's query heads use.

    With fewer kv heads than tensor shards, the kv heads are replicated (sharding.py) while the
    query heads are split, so each device holds every kv head but needs only one: the group its
    query heads belong to. (Outside a shard_map, sharding propagation does this on its own.)
    """
    if q_axes is None or q_axes == kv_axes:
        return k, v  # heads not split, or split alike: the local heads already pair up
    shards = jax.lax.psum(1, q_axes)
    index = jax.lax.axis_index(q_axes)
    group = q.shape[2] * shards // k.shape[2]  # query heads per kv head, over the whole model
    first = index * q.shape[2] // group  # this shard's query heads all fall in this one group
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, first, 1, axis=2)  # noqa: E731
    return take(k), take(v)
