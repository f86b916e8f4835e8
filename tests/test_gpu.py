"""On an NVIDIA GPU only (skipped elsewhere): every attention implementation against XLA's reference on
packed documents, forward and gradients, in bf16 against an fp32 reference at a fixed tolerance.

The cases, the reference and the tolerance live in bench/gpu_checks/attention.py, whose `make gpu-check` reports the
same comparisons as a table: one definition for both."""

import sys
from pathlib import Path

import jax
import pytest

from llama_jax.model import cudnn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from gpu_checks.attention import BF16_TOLERANCE, GPU_SHAPE, PARITY_CASES, attention_errors  # noqa: E402

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")


@pytest.mark.parametrize(
    "case",
    PARITY_CASES,
    ids=lambda case: f"{case.implementation}-{case.documents}-documents-{case.sequence_shards}-devices",
)
def test_attention_matches_xla_on_packed_documents(case):
    output_error, gradient_error = attention_errors(case, GPU_SHAPE)
    assert output_error < BF16_TOLERANCE
    assert gradient_error < BF16_TOLERANCE


def test_this_gpu_runs_the_packed_layout():
    """An H100/H200 with cuDNN >= 9.6: the packed case above exercised cuDNN's packed layout."""
    if not cudnn.cudnn.check_compute_capability("9.0"):
        pytest.skip("the packed layout needs a Hopper or newer GPU")
    assert cudnn.packed_layout_supported()
