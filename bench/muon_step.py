"""What Muon adds to a GPU step: the llama3_8b step on its documented layout (32 H100s, fsdp=32; its first stage,
4M-token batches of 4,096-token sequences) compiled by XLA:GPU on this machine with train.optimizer=adamw and
with train.optimizer=muon, and plan's prediction of each printed side by side, in one run:

    .venv-newest/bin/python bench/muon_step.py [--target h100] [--gpus 32] [--json FILE] [key=value ...]

The prediction is `llama-jax plan --target`'s (perf/costmodel.py: each compiled operation at 70% of the data
sheet's peak FLOPs or at its memory bandwidth, whichever is longer; the collectives at the links' speeds), and the
optimizer's collectives are those under its named scope (plan's `of it the optimizer`). Nothing runs on a GPU:
the figures say what the compiled programs cost in the cost model, not what an H100 measured. Needs jax's CUDA
plugin (the gpu extra, Python >= 3.12).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FIRST_STAGE = ["train.stages=[]"]


def plan_both(target: str, gpus: int, overrides: list[str]) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPUs: no driver needed (cli/arguments.py)
    from llama_jax.config import load_config
    from llama_jax.distributed import sharding
    from llama_jax.perf import gpu_target
    from llama_jax.planning.plan import make_plan

    devices = list(gpu_target.devices(target, gpus, 0))
    plans = {}
    for optimizer in ("adamw", "muon"):
        config = load_config("llama3_8b", [*FIRST_STAGE, *overrides, f"train.optimizer={optimizer}"])
        plan = make_plan(config, sharding.make_mesh(config, devices))
        plans[optimizer] = {
            "predicted_step_s": plan.predicted_step_s,
            "microbatches": plan.microbatches,
            "memory_gib": plan.total_bytes / 2**30,
            "hlo_tflops": plan.hlo_flops / 1e12,
            "collective_gib": plan.collective_total / 2**30,
            "optimizer_collective_gib": plan.optimizer_collective_bytes / 2**30,
            "compile_s": plan.compile_seconds,
        }
    return plans


def report(plans: dict, target: str, gpus: int) -> str:
    rows = [
        ("predicted step (s)", "predicted_step_s", "{:.3f}"),
        ("micro-batches", "microbatches", "{}"),
        ("memory per GPU (GiB)", "memory_gib", "{:.1f}"),
        ("HLO TFLOP per step", "hlo_tflops", "{:,.0f}"),
        ("collectives per GPU (GiB)", "collective_gib", "{:.2f}"),
        ("  of it the optimizer's", "optimizer_collective_gib", "{:.3f}"),
    ]
    lines = [f"llama3_8b, first stage, {gpus} x {target} (XLA:GPU compile, plan's cost model)"]
    lines.append(f"  {'':<28}{'adamw':>12}{'muon':>12}")
    lines += [f"  {name:<28}" + "".join(f"{fmt.format(plans[o][key]):>12}" for o in plans) for name, key, fmt in rows]
    added = plans["muon"]["predicted_step_s"] - plans["adamw"]["predicted_step_s"]
    lines.append(f"  Muon adds {added:.3f} s to the step: {added / plans['adamw']['predicted_step_s']:.1%}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="h100")
    parser.add_argument("--gpus", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("settings", nargs="*", metavar="key=value", help="more overrides of llama3_8b")
    args = parser.parse_args()
    plans = plan_both(args.target, args.gpus, args.settings)
    print(report(plans, args.target, args.gpus))
    if args.json:
        args.json.write_text(json.dumps(plans, indent=2))


if __name__ == "__main__":
    main()
