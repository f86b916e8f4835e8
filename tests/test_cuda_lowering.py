"""The GPU attention path, checked on this CPU machine by lowering for CUDA and reading the module.

Lowering cuDNN attention needs two answers that only a GPU machine gives: the cuDNN version (jax
asks the CUDA plugin, absent here) and the GPU's compute capability (the packed layout needs Hopper).
Both are an H100's: the train steps are lowered by step.lower_step (bench/lower.py's code), which traces
for the GPU (its TraceContext) and answers jax's checks as an H100 would (model/jax_workarounds.py); the
attention calls alone patch them (the `hopper` fixture). Everything else (our layout of packed documents,
the kernel choice, the shard_map for more tensor shards than kv heads, the rest of the train step) lowers
for real.
"""

import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax.config import load_config
from llama_jax.model import cudnn
from llama_jax.model.attention import attention, document_mask
from llama_jax.model.context import TraceContext
from llama_jax.model.context_parallel import XLA_KERNEL
from llama_jax.training.program import lower_step

SEQ = 1024


@pytest.fixture
def hopper():
    with (
        mock.patch.object(cudnn.cudnn, "check_cudnn_version", lambda: 91000),
        mock.patch.object(cudnn.cudnn, "check_compute_capability", lambda capability: True),
    ):
        yield


def square_tensors(module_text: str, size: int = SEQ) -> list[str]:
    """Shapes in the module with two dimensions of the sequence's length: a [.., T, T] mask, bias or scores."""
    shapes = set(re.findall(r"tensor<([0-9x]+)x(?:[a-z]+[0-9]*)>", module_text))
    return sorted(s for s in shapes if s.split("x").count(str(size)) >= 2)


def custom_calls(module_text: str) -> set[str]:
    return set(re.findall(r"custom_call @([\w$]+)", module_text)) | set(
        re.findall(r'call_target_name = "([^"]+)"', module_text)
    )


def test_segment_layout_is_cudnns_packed_layout():
    ids = np.zeros((3, 12), np.int32)
    ids[0, :5], ids[0, 5:9] = 1, 2  # two documents, then padding
    ids[1, :] = 1  # one document filling the row
    ids[2, :3], ids[2, 3:6], ids[2, 6:8], ids[2, 8:] = 1, 2, 3, 4  # more documents than max_segments
    lengths, offsets, documents = (np.asarray(a) for a in cudnn.segment_layout(jnp.asarray(ids), 3))
    assert documents.tolist() == [3, 1, 4]
    assert lengths.tolist() == [[5, 4, 3], [12, -1, -1], [3, 3, 2]]
    assert offsets.tolist() == [[0, 5, 9, -1], [0, -1, -1, -1], [0, 3, 6, -1]]


def test_packed_documents_lower_to_cudnn_without_any_t_by_t_tensor(hopper):
    q = jax.ShapeDtypeStruct((2, SEQ, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, SEQ, 2, 64), jnp.bfloat16)
    segments = jax.ShapeDtypeStruct((2, SEQ), jnp.int32)

    def loss(q, k, v, segments):
        return (
            attention(q, k, v, segments, "cudnn", max_segments=16, context=TraceContext("gpu"))
            .astype(jnp.float32)
            .sum()
        )

    text = (
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        .trace(q, kv, kv, segments)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= custom_calls(text)
    assert square_tensors(text) == []

    def dense_mask_loss(q, k, v, segments):  # what jax.nn.dot_product_attention needs for packed documents
        mask = document_mask(segments, segments)
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="cudnn").sum()

    dense = jax.jit(jax.grad(dense_mask_loss)).trace(q, kv, kv, segments).lower(lowering_platforms=("cuda",))
    assert square_tensors(dense.as_text())  # the check sees a T x T mask when there is one


def test_train_step_with_more_tensor_shards_than_kv_heads_lowers_with_attention_in_a_shard_map():
    """tensor=8 > 4 kv heads (as Llama 3 70B/405B at tensor=16 > 8): jax's cuDNN partitioner would
    reject q split and k/v replicated, so each device runs cuDNN on its own kv head in a shard_map."""
    config = load_config(
        "tiny",
        [
            "model.d_model=256",
            "model.n_heads=8",
            "model.n_kv_heads=4",
            "model.n_layers=1",
            "model.compute_dtype=bfloat16",
            f"train.seq_len={SEQ}",
            "train.batch_size=2",
            "mesh.tensor=8",
            "mesh.fsdp=1",
        ],
    )
    text = lower_step(config, "cuda").as_text()  # model.attention=auto: cuDNN, as on a GPU
    assert "__cudnn$fmhaSoftmax" in custom_calls(text)
    assert "sdy.manual_computation" in text or "SPMDFullToShardShape" in custom_calls(text)
    assert square_tensors(text) == []


def test_context_parallel_train_step_lowers_to_cudnn_calls_without_any_quadratic_tensor():
    """sequence=2, load-balanced: each device holds two chunks of T/4 tokens. Each chunk runs cuDNN on its own
    block (causal, or the packed layout) and cuDNN's padded call on the visible prefix of earlier chunks
    (PADDING: no mask tensor, the padding skipped), combined by log-sum-exp with cuDNN's backward from the
    combined statistics. No tensor anywhere has two dimensions among T, T/2 and T/4 (a mask, bias or scores
    of a chunk against the sequence); tensor=4 > 2 kv heads runs it all in the shard_map."""
    seq = 2048
    config = load_config(
        "tiny",
        [
            "model.d_model=256",
            "model.n_heads=8",
            "model.n_kv_heads=2",
            "model.n_layers=1",
            "model.compute_dtype=bfloat16",
            f"model.max_seq_len={seq}",
            f"train.seq_len={seq}",
            "train.batch_size=2",
            "mesh.sequence=2",
            "mesh.tensor=4",
            "mesh.fsdp=1",
        ],
    )
    assert cudnn.PADDED_KERNEL is not XLA_KERNEL
    text = lower_step(config, "cuda").as_text()
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= custom_calls(text)
    masks = set(re.findall(r"mask_type[^A-Z]{1,12}([A-Z_]+)", text))
    assert {"PADDING", "PADDING_CAUSAL", "CAUSAL"} <= masks
    lengths = {str(seq), str(seq // 2), str(seq // 4)}
    shapes = set(re.findall(r"tensor<([0-9x]+)x(?:[a-z]+[0-9]*)>", text))
    assert [s for s in shapes if sum(d in lengths for d in s.split("x")) >= 2] == []
    assert "sdy.manual_computation" in text or "SPMDFullToShardShape" in custom_calls(text)


def test_gpu_checks_context_parallel_rows_lower_to_cudnn_on_one_device(hopper):
    """make gpu-check runs every device's share of context parallelism in turn on one GPU: it lowers to cuDNN."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from gpu_checks import attention

    q, k, v, _ = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in attention.attention_inputs(attention.SMOKE_SHAPE))
    segments = jax.ShapeDtypeStruct(q.shape[:2], jnp.int32)

    def loss(q, k, v, segments):
        out = attention.context_parallel_on_one_device(q, k, v, segments, "cudnn", 16, shards=4)
        return out.astype(jnp.float32).sum()

    text = (
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        .trace(q, k, v, segments)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= custom_calls(text)


def test_bench_lower_prints_the_train_step_lowered_for_cuda(tmp_path):
    """`python bench/lower.py PRESET key=value ... --platform cuda`: the module of lower_step, on any machine;
    bad input is one line and exit 2."""
    script = Path(__file__).resolve().parents[1] / "bench" / "lower.py"
    args = [sys.executable, str(script), "tiny", "model.compute_dtype=bfloat16", "model.n_layers=1"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as on a laptop
    run = subprocess.run(
        args + ["--platform", "cuda", "--out", str(tmp_path / "step.mlir")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    text = (tmp_path / "step.mlir").read_text()
    assert text.startswith("module @jit_train_step")
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= custom_calls(text)
    bad = subprocess.run(
        args + ["model.n_heads=3", "--platform", "cuda"], capture_output=True, text=True, timeout=300, env=env
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
