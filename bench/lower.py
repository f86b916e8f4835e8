"""Print the train step's StableHLO, lowered for a platform on this machine (no GPU needed for CUDA).

    python bench/lower.py [PRESET|CONFIG.yaml] [key=value ...] --platform cuda [--target h100] [--out FILE]

The step is traced with the kernels that platform runs (cuDNN attention, einsum projections on GPUs) on this
process's devices (XLA_FLAGS=--xla_force_host_platform_device_count=N for a mesh of N) and lowered, compiled by
nothing: the module says which operations, types and custom calls a GPU would be given, e.g. whether a
projection's operands are fp8 or attention is one cuDNN call without a [T, T] tensor. For CUDA, jax's cuDNN
checks, which would ask a local GPU, answer as --target's GPU (default h100). train.microbatches=auto becomes 1
(or a pipeline's stage count). The code is llama_jax.training.step.lower_step, which tests/test_cuda_lowering.py
reads modules with. To compile for a GPU cluster instead: llama-jax plan ... --target h100 --gpus N.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("args", nargs="*", metavar="PRESET|CONFIG|key=value")
    parser.add_argument("--platform", default="cuda", choices=("cuda", "rocm", "tpu", "cpu"))
    parser.add_argument("--target", default="h100", help="the GPU jax's cuDNN checks answer for (default h100)")
    parser.add_argument("--out", help="write the module here instead of printing it")
    args = parser.parse_args()
    from llama_jax.config import load_config
    from llama_jax.errors import LlamaJaxError
    from llama_jax.training.program import lower_step

    source, overrides = (args.args[0], args.args[1:]) if args.args and "=" not in args.args[0] else (None, args.args)
    try:
        text = lower_step(load_config(source, overrides), args.platform, args.target).as_text()
    except LlamaJaxError as err:  # bad input: one line, exit 2, as llama-jax says it
        sys.stderr.write(f"bench/lower.py: error: {err}\n")
        sys.exit(err.exit_code)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
