"""Attention forward + backward at Llama 3 8B's head shape, each implementation side by side, in one run.

    python bench/attention.py [--seq 8192] [--batch 1] [--documents 8] [--steps 10]
    python bench/attention.py --seq 512 --batch 8 --heads 8 --kv-heads 4 --head-dim 64 --dtype float32 \
        --documents 1 --blocks 64,128,256       # the `bench` preset's attention; the blocked kernel by block length

Rows: our kernels (llama_jax.model.attention.attention: cuDNN's packed layout / plain causal cuDNN / the
blocked kernel; cuDNN's exact fallback for rows with too many documents) and, for comparison,
jax.nn.dot_product_attention with the dense [B, 1, T, T] document mask that packed documents needed
before (on a GPU with cuDNN). Each row: median milliseconds of
--steps jitted fwd+bwd calls after 2 warm-ups, the attention TFLOP/s of the work the mask leaves
(4·N·H FLOPs per visible query-key pair, L(L+1)/2 pairs per document of L tokens, x 3 for forward +
backward, the MFU convention) and the compiled program's temporary memory. --blocks adds a row of the blocked
kernel for each block length given (flash.block_size picks one; these rows are what it was chosen from).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.model.attention import attention, document_mask
from llama_jax.model.context import TraceContext
from llama_jax.model.cudnn import query_chunked_attention
from llama_jax.model.flash import block_size, blocked_attention

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama 3 8B


def segments_of(batch: int, seq: int, documents: int) -> np.ndarray:
    """`documents` equal documents per row (one: no packing)."""
    return np.repeat(np.arange(1, documents + 1, dtype=np.int32), -(-seq // documents))[:seq][None].repeat(batch, 0)


def dense_mask_cudnn(q, k, v, segments):
    return jax.nn.dot_product_attention(
        q, k, v, mask=document_mask(segments, segments), is_causal=True, implementation="cudnn"
    )


def measure(fn, q, k, v, segments, steps: int) -> tuple[float, int]:
    grad = jax.jit(jax.grad(lambda q, k, v, s: fn(q, k, v, s).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    compiled = grad.lower(q, k, v, segments).compile()
    temporary = compiled.memory_analysis().temp_size_in_bytes
    times = []
    for i in range(2 + steps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v, segments))
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times), temporary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS)
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--blocks", default="", help="comma-separated block lengths for the blocked kernel's rows")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    b, t, heads, head_dim = args.batch, args.seq, args.heads, args.head_dim
    q = jnp.asarray(rng.standard_normal((b, t, heads, head_dim)), args.dtype)
    k, v = (jnp.asarray(rng.standard_normal((b, t, args.kv_heads, head_dim)), args.dtype) for _ in range(2))
    packed, single = jnp.asarray(segments_of(b, t, args.documents)), jnp.asarray(segments_of(b, t, 1))

    def flops(segments) -> float:  # of the visible (query, key) pairs: causal, within documents
        lengths = np.unique(np.asarray(segments[0]), return_counts=True)[1]
        return 3 * 4 * heads * head_dim * b * float(np.sum(lengths * (lengths + 1) / 2))

    on_gpu = jax.default_backend() == "gpu"
    rows = [
        (f"ours, cuDNN packed layout ({args.documents} documents/row)", "cudnn", packed),
        ("ours, cuDNN plain causal (1 document/row)", "cudnn", single),
        (f"ours, blocked kernel, blocks of {block_size(t)} ({args.documents} documents/row)", "blocked", packed),
    ]
    print(
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}: B={b} T={t} heads {heads}/{args.kv_heads} "
        f"head_dim {head_dim}, {args.dtype}, forward + backward"
    )
    kernels = {
        name: lambda q, k, v, s, i=implementation: attention(q, k, v, s, i, context=TraceContext.local())
        for name, implementation, _ in rows
    }
    for block in (int(x) for x in args.blocks.split(",") if x):
        name = f"blocked kernel, blocks of {block}"
        rows.append((name, "blocked", packed))
        kernels[name] = lambda q, k, v, s, block=block: blocked_attention(q, k, v, s, block)
    for name, implementation, segments in rows:
        if implementation == "cudnn" and not on_gpu:
            continue
        seconds, temporary = measure(kernels[name], q, k, v, segments, args.steps)
        print(
            f"{name:<52} {seconds * 1e3:9.2f} ms {flops(segments) / seconds / 1e12:8.3f} TFLOP/s "
            f"{temporary / 2**30:7.2f} GiB temporary"
        )
    seconds, temporary = measure(query_chunked_attention, q, k, v, packed, args.steps)
    print(
        f"{'ours, XLA fallback (rows over attention_max_segments)':<52} {seconds * 1e3:9.2f} ms "
        f"{flops(packed) / seconds / 1e12:8.3f} TFLOP/s {temporary / 2**30:7.2f} GiB temporary"
    )
    if on_gpu:
        seconds, temporary = measure(dense_mask_cudnn, q, k, v, packed, args.steps)
        print(
            f"{'before: jax.nn cuDNN with a dense [B,1,T,T] mask':<52} {seconds * 1e3:9.2f} ms "
            f"{flops(packed) / seconds / 1e12:8.3f} TFLOP/s {temporary / 2**30:7.2f} GiB temporary"
        )


if __name__ == "__main__":
    main()
