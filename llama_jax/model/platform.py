"""The platform a step is traced for: that of the devices it will run on, not always this process's.

The model picks kernels by platform: cuDNN attention on GPUs, the projections' CPU backward pass on CPUs, fp32
sums over pipeline stages on CPUs. `llama-jax plan --target h100` compiles the step for GPUs on a machine
without one (perf/gpu_target.py: compile-only GPUs), and bench/lower.py lowers it for CUDA on this machine's
CPUs, so the choice follows the devices compiled for, not jax.default_backend(): TrainProgram traces inside
tracing_for(its mesh's platform). Elsewhere (decoding, tests that call the model directly) it is this
process's backend.

jax's cuDNN attention also asks this process for its GPU's compute capability and its cuDNN version while
tracing (the packed layout and head dims above 128 need Hopper; without cuDNN it refuses). Compiled or lowered
for a GPU that is not here, those questions are answered for that GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import jax
from jax._src.cudnn import fused_attention_stablehlo as jax_cudnn  # private: cudnn.py's too

_TRACED_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("llama_jax_platform", default=None)


@dataclass(frozen=True)
class Gpu:
    """What jax's cuDNN checks ask of a GPU that is not here."""

    compute_capability: str  # e.g. "9.0"
    cudnn_version: int  # as cuDNN reports it: 9.19.0 -> 91900


def backend() -> str:
    """'cpu', 'gpu' or 'tpu': the platform of the step being traced, else this process's backend."""
    return _TRACED_FOR.get() or jax.default_backend()


@contextlib.contextmanager
def tracing_for(platform: str, gpu: Gpu | None = None) -> Iterator[None]:
    """Trace for `platform`; with `gpu` (one that is not here) jax's cuDNN checks answer for it."""
    token = _TRACED_FOR.set(platform)
    try:
        with _cudnn_checks_answered_by(gpu) if gpu else contextlib.nullcontext():
            yield
    finally:
        _TRACED_FOR.reset(token)


def _version(capability: str) -> tuple[int, ...]:
    return tuple(int(part) for part in capability.split("."))


@contextlib.contextmanager
def _cudnn_checks_answered_by(gpu: Gpu) -> Iterator[None]:
    # jax's own checks (its private module, which cudnn.py calls too) read xla_bridge's default backend, which
    # on a machine planning for GPUs is the CPU, and the local cuDNN, which a CPU-only jax does not have: they
    # would refuse the packed layout as if the GPU were pre-Hopper, or cuDNN as not installed.
    answers = {"check_compute_capability": lambda wanted: _version(gpu.compute_capability) >= _version(wanted),
               "is_cuda_compute_capability_equal": lambda wanted: _version(gpu.compute_capability) == _version(wanted),
               "check_cudnn_version": lambda: gpu.cudnn_version}
    saved = {name: getattr(jax_cudnn, name) for name in answers}
    for name, answer in answers.items():
        setattr(jax_cudnn, name, answer)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(jax_cudnn, name, function)
