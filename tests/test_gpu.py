"""On an NVIDIA GPU only (skipped elsewhere): every attention implementation against XLA's reference on
packed documents, forward and gradients, in bf16 against an fp32 reference at a fixed tolerance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax import cudnn
from llama_jax.attention import attention, document_mask

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")

BF16_TOLERANCE = 2e-2  # max error relative to the largest magnitude, bf16 inputs vs an fp32 reference
BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 2048, 16, 4, 128


def packed_segments(documents: int) -> np.ndarray:
    """Rows of `documents` documents of uneven lengths, the second row ending in padding (segment 0)."""
    rng = np.random.default_rng(documents)
    ids = np.zeros((BATCH, SEQ), np.int32)
    for row, used in enumerate((SEQ, SEQ - 300)):
        cuts = np.sort(rng.choice(np.arange(1, used), documents - 1, replace=False)) if documents > 1 else []
        for doc, (start, end) in enumerate(zip([0, *cuts], [*cuts, used]), start=1):
            ids[row, start:end] = doc
    return ids


def reference(q, k, v, segments):
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    with jax.default_matmul_precision("highest"):
        return jax.nn.dot_product_attention(q, k, v, mask=document_mask(segments, segments), is_causal=True,
                                            implementation="xla")


def relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("implementation, documents, max_segments", [
    ("cudnn", 1, 16),  # one document per row: plain causal cuDNN
    ("cudnn", 6, 16),  # packed: cuDNN's packed layout
    ("cudnn", 24, 16),  # more documents than max_segments: the blocked kernel for this batch
    ("blocked", 6, 16),
])
def test_attention_matches_xla_on_packed_documents(implementation, documents, max_segments):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((BATCH, SEQ, HEADS, HEAD_DIM)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((BATCH, SEQ, KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((BATCH, SEQ, KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    segments = jnp.asarray(packed_segments(documents))

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * weights)

    ours = jax.jit(lambda q, k, v: attention(q, k, v, segments, None, implementation, max_segments))
    want = reference(q, k, v, segments)
    assert relative_error(ours(q, k, v), want) < BF16_TOLERANCE
    got_grads = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
    want_grads = jax.grad(loss(lambda q, k, v: reference(q, k, v, segments)), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(got_grads, want_grads):
        assert relative_error(got, want) < BF16_TOLERANCE


def test_this_gpu_runs_the_packed_layout():
    """An H100/H200 with cuDNN >= 9.6: the packed case above exercised cuDNN's packed layout."""
    if not cudnn.cudnn.check_compute_capability("9.0"):
        pytest.skip("the packed layout needs a Hopper or newer GPU")
    assert cudnn.packed_layout_supported()
