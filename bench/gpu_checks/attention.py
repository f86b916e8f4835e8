"""gpu-check's attention parity: every path of llama_jax.model.attention on packed documents with GQA in bf16,
output and gradients against an fp32 XLA reference. tests/test_gpu.py runs the same cases from this file."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from gpu_checks.table import Row, first_line
from llama_jax.model import cudnn
from llama_jax.model.attention import attention, context_parallel_kernels, document_mask
from llama_jax.model.context import TraceContext
from llama_jax.model.context_parallel import chunk_order, device_attention

BF16_TOLERANCE = 2e-2  # max error relative to the largest magnitude, bf16 inputs vs an fp32 reference


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    padding: int  # trailing padding tokens (segment 0) of the last row


# Grouped-query attention: 4 query heads per kv head.
GPU_SHAPE = AttentionShape(batch=2, seq=2048, heads=16, kv_heads=4, head_dim=128, padding=300)
# Small enough for a CPU, long enough for the blocked kernel (flash.MIN_SEQ: four blocks of 64 tokens).
SMOKE_SHAPE = AttentionShape(batch=2, seq=256, heads=4, kv_heads=2, head_dim=32, padding=32)


@dataclass(frozen=True)
class ParityCase:
    implementation: str  # model.attention: cudnn | blocked | xla
    documents: int  # per row
    max_segments: int  # model.attention_max_segments
    label: str
    sequence_shards: int = 1  # context parallelism over this many devices, simulated on one (load-balanced)


PARITY_CASES = (
    ParityCase("cudnn", 1, 16, "cuDNN causal, 1 document/row"),
    ParityCase("cudnn", 6, 16, "cuDNN packed layout, 6 documents/row"),
    ParityCase("cudnn", 24, 16, "cuDNN's exact fallback, 24 documents/row > 16"),
    ParityCase("blocked", 6, 16, "blocked kernel, 6 documents/row"),
    ParityCase("xla", 6, 16, "XLA kernel, 6 documents/row"),
    ParityCase("cudnn", 6, 16, "context parallel on cuDNN, 4 devices, 6 documents/row", sequence_shards=4),
    ParityCase("cudnn", 1, 16, "context parallel on cuDNN, 4 devices, 1 document/row", sequence_shards=4),
    ParityCase("blocked", 6, 16, "context parallel on XLA, 4 devices, 6 documents/row", sequence_shards=4),
)


def packed_segments(documents: int, shape: AttentionShape) -> np.ndarray:
    """Rows of `documents` documents of uneven lengths, the last row ending in padding (segment 0)."""
    rng = np.random.default_rng(documents)
    ids = np.zeros((shape.batch, shape.seq), np.int32)
    for row in range(shape.batch):
        used = shape.seq - (shape.padding if row == shape.batch - 1 else 0)
        cuts = np.sort(rng.choice(np.arange(1, used), documents - 1, replace=False)) if documents > 1 else []
        for doc, (start, end) in enumerate(zip([0, *cuts], [*cuts, used]), start=1):
            ids[row, start:end] = doc
    return ids


def attention_inputs(shape: AttentionShape) -> tuple[jax.Array, ...]:
    """q, k, v in bf16 and the fp32 weights of the loss sum(out * weights) whose gradients are compared."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((shape.batch, shape.seq, shape.heads, shape.head_dim)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((shape.batch, shape.seq, shape.kv_heads, shape.head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((shape.batch, shape.seq, shape.kv_heads, shape.head_dim)), jnp.bfloat16)
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    return q, k, v, weights


def context_parallel_on_one_device(q, k, v, segments, implementation: str, max_segments: int, shards: int):
    """The context-parallel path of `shards` load-balanced devices run on this one: each device's share in
    turn, given its slice of the queries and the whole sequence's keys (what its all-gathers would bring)."""
    order = chunk_order(shards, balanced=True)
    size = q.shape[1] // len(order)
    chunk = lambda x, c: x[:, c * size : (c + 1) * size]  # noqa: E731
    in_chunk, kernel = context_parallel_kernels(implementation, max_segments, size)
    outs = {}
    for device in range(shards):
        mine = order[2 * device : 2 * device + 2]
        local = [jnp.concatenate([chunk(x, c) for c in mine], axis=1) for x in (q, k, v, segments)]
        out = device_attention(*local, k, v, segments, device, shards, True, in_chunk, kernel)
        outs.update({c: chunk(out, i) for i, c in enumerate(mine)})
    return jnp.concatenate([outs[c] for c in range(len(order))], axis=1)


def reference(q, k, v, segments):
    """XLA's attention in fp32 at full matmul precision (no TF32): what every kernel is compared with."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    with jax.default_matmul_precision("highest"):
        return jax.nn.dot_product_attention(
            q, k, v, mask=document_mask(segments, segments), is_causal=True, implementation="xla"
        )


def relative_error(got, want) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def outputs_and_gradients(fn, q, k, v, segments, weights):
    """fn(q, k, v, segments) and the gradients of sum(output * weights) by q, k and v: one compiled program."""

    def run(q, k, v, segments, weights):
        out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, segments), q, k, v)
        return out, pullback(weights.astype(out.dtype))

    return jax.jit(run)(q, k, v, segments, weights)


def attention_errors(case: ParityCase, shape: AttentionShape, references: dict | None = None) -> tuple[float, float]:
    """(output error, worst gradient error) of one case against the fp32 reference. `references` keeps the
    reference's results by document count, so cases on the same documents compute it once."""
    q, k, v, weights = attention_inputs(shape)
    segments = jnp.asarray(packed_segments(case.documents, shape))

    def ours(q, k, v, s):
        if case.sequence_shards > 1:
            return context_parallel_on_one_device(
                q, k, v, s, case.implementation, case.max_segments, case.sequence_shards
            )
        return attention(q, k, v, s, case.implementation, case.max_segments, context=TraceContext.local())

    got, got_grads = outputs_and_gradients(ours, q, k, v, segments, weights)
    references = {} if references is None else references
    if case.documents not in references:
        references[case.documents] = outputs_and_gradients(reference, q, k, v, segments, weights)
    want, want_grads = references[case.documents]
    return relative_error(got, want), max(relative_error(g, w) for g, w in zip(got_grads, want_grads))


def kernel_ran(case: ParityCase) -> str:
    """What a cuDNN case runs on this GPU: without the packed layout (before Hopper or cuDNN 9.6), packed rows
    take the blocked kernel instead, and the row says so."""
    if case.implementation == "cudnn" and case.documents > 1 and not cudnn.packed_layout_supported():
        return "no packed layout on this GPU/cuDNN: the blocked kernel ran"
    return ""


def attention_section(shape: AttentionShape, cudnn_available: bool) -> tuple[list[Row], list[dict]]:
    rows, figures, references = [], [], {}
    tolerance = f"max |error| / max |fp32 reference|, pass < {BF16_TOLERANCE:g}"
    for case in PARITY_CASES:
        entry = {**dataclasses.asdict(case), "tolerance": BF16_TOLERANCE}
        if case.implementation == "cudnn" and not cudnn_available:
            rows.append(
                Row("attention", case.label, "skipped: needs cuDNN", "", "no NVIDIA GPU: this path did not run")
            )
            figures.append({**entry, "status": "skipped"})
            continue
        note = kernel_ran(case) if cudnn_available else ""
        try:
            output_error, gradient_error = attention_errors(case, shape, references)
        except Exception as error:  # a kernel that fails to compile or run is a failed row; the other rows still run
            rows.append(Row("attention", case.label, "FAIL", "error", first_line(error)))
            figures.append({**entry, "status": "FAIL", "error": first_line(error)})
            continue
        status = "pass" if max(output_error, gradient_error) < BF16_TOLERANCE else "FAIL"
        rows.append(
            Row(
                "attention",
                case.label,
                status,
                f"out {output_error:.4f}, grad {gradient_error:.4f}",
                f"{tolerance}{'; ' + note if note else ''}",
            )
        )
        figures.append(
            {
                **entry,
                "status": status,
                "output_error": output_error,
                "gradient_error": gradient_error,
                "kernel_note": note,
            }
        )
    return rows, figures
