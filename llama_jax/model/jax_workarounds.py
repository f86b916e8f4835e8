"""The jax limitations this code works around, in one place, each with the jax versions it applies to; the only
module of the package that imports jax's private modules (jax._src), each for what no public API offers in jax
0.10 to 0.12 (PRIVATE_APIS_CHECKED), tests/test_trace_context.py failing when jax offers it:

    jax_cudnn                   cuDNN attention's packed layout (q_seqlen / q_offsets, cudnn.py): the public
                                jax.nn.dot_product_attention takes padding lengths only
    distributed_client()        the coordination service's key-value client (distributed/peers.py's barriers and
                                broadcasts, as Orbax reads it): jax.distributed has no handle on it
    compilation_cache_off()     a scope without the persistent compilation cache (perf/xla_log.py: XLA speaks only
                                when it compiles): jax.config's flag has no public context manager

cuDNN checks that ask this process, not the GPU compiled for (jax >= 0.10, < 0.13: CUDNN_CHECKS_APPLY_TO).
jax's cuDNN attention (jax._src.cudnn.fused_attention_stablehlo, which cudnn.py calls, as does
jax.nn.dot_product_attention) asks, while tracing, for the GPU's compute capability (check_compute_capability,
is_cuda_compute_capability_equal: the packed layout and head dims above 128 need Hopper) and for the cuDNN
version (check_cudnn_version). It asks this process's default backend and its local cuDNN, never the devices the
step is compiled for; no argument or public API passes the target's answers. A step traced for a GPU that is not
here (`llama-jax plan --target h100`: perf/gpu_target.py; training/step.lower_step for CUDA on this machine's
CPUs) would see the packed layout refused as if the GPU were pre-Hopper, or cuDNN as not installed. The checks
run inside jax's forward and backward rules, which are traced where autodiff reaches them (inside scans and
pipeline loops, after the call), so the answers hold for the whole trace: TrainProgram.activate applies
cudnn_checks_answered_by(context.gpu) around it, and restores jax's functions after.

tests/test_trace_context.py fails when the installed jax leaves CUDNN_CHECKS_APPLY_TO or its checks stop
answering from this process's backend: then check whether jax takes the target's answers and drop this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
from jax._src import config as jax_config
from jax._src import distributed as jax_distributed
from jax._src.cudnn import fused_attention_stablehlo as jax_cudnn

from llama_jax.model.context import Gpu

CUDNN_CHECKS_APPLY_TO = ("0.10", "0.13")  # jax versions >= the first, < the second (checked: 0.10.2, 0.12)
PRIVATE_APIS_CHECKED = ("0.10", "0.13")  # the private modules above, read in these versions (checked: 0.10.2, 0.12)


def distributed_client():
    """jax.distributed's coordination client: its barriers and key-value store (None until jax.distributed joined)."""
    return jax_distributed.global_state.client


def compilation_cache_off():
    """A context in which compilations neither read nor write the persistent compilation cache."""
    return jax_config.enable_compilation_cache(False)


CUDNN_CHECKS = ("check_compute_capability", "is_cuda_compute_capability_equal", "check_cudnn_version")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())


def applies(version: str = jax.__version__, versions: tuple[str, str] = CUDNN_CHECKS_APPLY_TO) -> bool:
    """Whether jax `version` is in the range a workaround was written and checked for."""
    return _version(versions[0]) <= _version(version) < _version(versions[1])


@contextlib.contextmanager
def cudnn_checks_answered_by(gpu: Gpu | None) -> Iterator[None]:
    """Within: jax's cuDNN checks answer for `gpu`, a GPU that is not here (None: as jax answers them)."""
    if gpu is None:
        yield
        return
    capability = _version(gpu.compute_capability)
    answers = {
        "check_compute_capability": lambda wanted: capability >= _version(wanted),
        "is_cuda_compute_capability_equal": lambda wanted: capability == _version(wanted),
        "check_cudnn_version": lambda: gpu.cudnn_version,
    }
    saved = {name: getattr(jax_cudnn, name) for name in CUDNN_CHECKS}  # an AttributeError: jax renamed them
    for name, answer in answers.items():
        setattr(jax_cudnn, name, answer)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(jax_cudnn, name, function)
