"""Do the llama3_* presets fit an 80 GB H100 at their documented device counts? One `llama-jax plan` per
preset, compiled on that many simulated CPU devices with run.device_memory_gb=72 (0.9 x 80 GiB), in one run.

    .venv/bin/python bench/presets.py [--presets llama3_8b,...] [key=value ...]

The documented layouts: 1B and 3B on one 8-GPU node (fsdp=8); 8B on the README's 4-node Slurm line
(32 GPUs, fsdp=32); 70B on 64 GPUs and 405B on 512 GPUs, each tensor=8 within a node and fsdp across
nodes (the presets set mesh.tensor=8). key=value overrides apply to every preset (e.g.
`train.microbatches=1 remat.policy=none` for the presets as they were). XLA:CPU's memory analysis
stands in for the GPU's; it keeps more than a GPU compile would (bf16 matmuls in fp32), so a preset
that fits here fits on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

DEVICES = {"llama3_1b": 8, "llama3_3b": 8, "llama3_8b": 32, "llama3_70b": 64, "llama3_405b": 512}
BUDGET_GB = 72


def plan(preset: str, overrides: list[str]) -> dict:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES[preset]}"}
    command = [sys.executable, "-m", "llama_jax", "plan", preset, *overrides, "--json"]
    # Run from / so `python -m llama_jax` imports the llama_jax of PYTHONPATH or the installed one, not the cwd's.
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd="/")
    if result.returncode:
        raise SystemExit(f"{preset}: {result.stderr.strip().splitlines()[-1]}")
    return json.loads(result.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(DEVICES))
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    from llama_jax.config import load_config
    from llama_jax.errors import ConfigError

    try:  # a llama_jax from before run.device_memory_gb existed is planned without it (its `before` figures)
        load_config("tiny", [f"run.device_memory_gb={BUDGET_GB}"])
        args.overrides.insert(0, f"run.device_memory_gb={BUDGET_GB}")
    except ConfigError:
        pass

    print(f"{'preset':<12}{'GPUs':>6}  {'mesh':<22}{'micro-batches':>14}  {'remat.policy':<22}{'GiB/device':>11}  "
          f"fits {BUDGET_GB} GiB  compile")
    for preset in args.presets.split(","):
        config = load_config(preset, args.overrides)
        p = plan(preset, args.overrides)
        mesh = " x ".join(f"{k}={v}" for k, v in p["mesh"].items() if v > 1)
        microbatches = p.get("microbatches", config.train.microbatches)
        gib = p["total_bytes"] / 2**30
        print(f"{preset:<12}{p['devices']:>6}  {mesh:<22}{microbatches:>14}  {config.remat.policy:<22}{gib:>11.1f}  "
              f"{'yes' if gib <= BUDGET_GB else 'NO':<14}{p['compile_seconds']:6.0f} s", flush=True)


if __name__ == "__main__":
    main()
