"""Do the llama3_* presets fit an 80 GB H100 at their documented device counts? Per preset, in one run, the train
step compiled by XLA:GPU for that many H100s (`llama-jax plan PRESET --target h100 --gpus N`: hosts of 8, budget
90% of 80 GiB) next to the CPU proxy (`llama-jax plan PRESET` on N simulated CPU devices with
run.device_memory_gb=72).

    .venv-gpu/bin/python bench/presets.py [--presets llama3_8b,...] [--target h100] [key=value ...]

The documented layouts: 1B and 3B on one 8-GPU node (fsdp=8); 8B on the README's 4-node Slurm line
(32 GPUs, fsdp=32); 70B on 64 GPUs and 405B on 512 GPUs, each tensor=8 within a node and fsdp across
nodes (the presets set mesh.tensor=8). key=value overrides apply to every preset (e.g.
`train.microbatches=1 remat.policy=none` for the presets as they were). The GPU figure is XLA:GPU's buffer
assignment plus cuDNN's attention workspace (estimated: perf/gpu_target.py); it needs jax's CUDA plugin (the gpu
extra, Python >= 3.12), and without it the column says so. XLA:CPU's figure stands in where there is no plugin: it
keeps bf16 matmuls in fp32 and has no cuDNN workspace. Each preset's `train.microbatches=auto` is resolved by each
compile against its own budget, so the two may choose different counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

DEVICES = {"llama3_1b": 8, "llama3_3b": 8, "llama3_8b": 32, "llama3_70b": 64, "llama3_405b": 512}
BUDGET_GB = 72


def plan(preset: str, overrides: list[str], target: str = "") -> dict:
    """`llama-jax plan --json` in a subprocess: on simulated CPU devices, or compiled for `target` GPUs."""
    if target:
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        env.pop("XLA_FLAGS", None)
        extra = ["--target", target, "--gpus", str(DEVICES[preset]), "--gpus-per-host", str(min(DEVICES[preset], 8))]
    else:
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES[preset]}"}
        extra = [f"run.device_memory_gb={BUDGET_GB}"] if budget_key_exists() else []
    command = [sys.executable, "-m", "llama_jax", "plan", preset, *extra, *overrides, "--json"]
    # Run from / so `python -m llama_jax` imports the llama_jax of PYTHONPATH or the installed one, not the cwd's.
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd="/")
    if result.returncode:
        raise SystemExit(f"{preset}: {result.stderr.strip().splitlines()[-1]}")
    report = json.loads(result.stdout)
    if "stages" in report:  # a staged recipe (docs/recipe.md): its largest stage decides whether it fits
        largest = report["summary"]["largest_memory_stage"]
        return {**report["stages"][largest - 1]["plan"], "stage": largest}
    return report


def budget_key_exists() -> bool:
    """A llama_jax from before run.device_memory_gb existed is planned without it (its `before` figures)."""
    from llama_jax.config import load_config
    from llama_jax.errors import ConfigError

    try:
        load_config("tiny", [f"run.device_memory_gb={BUDGET_GB}"])
        return True
    except ConfigError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(DEVICES))
    parser.add_argument("--target", default="h100", help="the GPUs XLA:GPU compiles for (default h100)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    from llama_jax.config import load_config

    try:
        from llama_jax.perf.gpu_target import plugin_missing

        missing = plugin_missing()
    except ImportError:  # a llama_jax from before --target
        missing = "this llama_jax has no --target"

    print(f"{'':<62}{'XLA:GPU, ' + args.target:<40}{'XLA:CPU proxy':<24}")
    print(
        f"{'preset':<12}{'GPUs':>6}  {'mesh':<22}{'remat.policy':<22}{'micro-batches':>13}{'GiB/device':>11}"
        f"{'(cuDNN)':>8}{'compile':>8}{'micro-batches':>15}{'GiB/device':>11}  fits"
    )
    for preset in args.presets.split(","):
        config = load_config(preset, args.overrides)
        cpu = plan(preset, args.overrides)
        mesh = " x ".join(f"{k}={v}" for k, v in cpu["mesh"].items() if v > 1)
        cpu_gib = cpu["total_bytes"] / 2**30
        gpu_columns, fits = f"{'-':>13}{'-':>11}{'':>8}{'':>8}", cpu_gib <= BUDGET_GB
        if missing is None:
            gpu = plan(preset, args.overrides, args.target)
            gpu_gib = gpu["total_bytes"] / 2**30
            gpu_columns = (
                f"{gpu['microbatches']:>13}{gpu_gib:>11.1f}{gpu['cudnn_workspace_bytes'] / 2**30:>8.1f}"
                f"{gpu['compile_seconds']:>6.0f} s"
            )
            fits = gpu_gib <= gpu["budget_bytes"] / 2**30
        name = preset + (f" ({cpu['stage']})" if "stage" in cpu else "")  # a staged recipe: its largest stage
        print(
            f"{name:<12}{cpu['devices']:>6}  {mesh:<22}{config.remat.policy:<22}{gpu_columns}"
            f"{cpu.get('microbatches', config.train.microbatches):>15}{cpu_gib:>11.1f}  {'yes' if fits else 'NO'}",
            flush=True,
        )
    if missing is not None:
        print(f"XLA:GPU column empty: {missing}")


if __name__ == "__main__":
    main()
