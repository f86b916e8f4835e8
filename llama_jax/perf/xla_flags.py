"""Whether this jaxlib knows the XLA flags in XLA_FLAGS that launch/gpu_env.sh sets: an older XLA aborts on an
unknown flag with a fatal log when it starts; every command checks first and says so in one line."""

from __future__ import annotations

import os

import jaxlib

from llama_jax.errors import InputError


def check_xla_flags() -> None:
    """launch/gpu_env.sh's collective pipelining flags exist from jaxlib 0.11.1 on; an older XLA aborts on them
    with a fatal log when it starts, on any host. One line instead, before anything starts."""
    version = tuple(int(part) for part in jaxlib.__version__.split(".")[:3] if part.isdigit())
    if "--xla_gpu_pipeline_" in os.environ.get("XLA_FLAGS", "") and version < (0, 11, 1):
        raise InputError(
            f"XLA_FLAGS has launch/gpu_env.sh's --xla_gpu_pipeline_* flags, which jaxlib "
            f"{jaxlib.__version__} does not know (they need 0.11.1 or newer): install the gpu extra on "
            "Python >= 3.12, or set LLAMA_JAX_GPU_FLAGS=off for the launch script"
        )
