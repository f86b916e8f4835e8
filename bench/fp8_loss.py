"""Does fp8 train as well as bf16? The same preset trained twice in this one invocation, same seed and data,
with bf16 projections and with model.fp8=tensorwise, and their eval losses printed side by side.

    .venv/bin/python bench/fp8_loss.py [--preset bench] [--steps 300] [--json out.json] [key=value ...]

Both runs use model.compute_dtype=bfloat16 (fp8 replaces the bf16 matmuls of the seven projections; the
rest of the model is the same in both) and `llama-jax train` as a user runs it, each in a fresh run
directory; evaluation at the preset's train.eval_every and at the end, on the same held-out batches. The
last line is a JSON object: eval losses of both per step, the final relative gap, tokens/s of each (on CPU
XLA emulates fp8, so the speed says nothing about a GPU's: `make gpu-check` measures that).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from llama_jax.training.metrics import read_metrics  # noqa: E402

RECIPES = {"bf16": ["model.compute_dtype=bfloat16"], "fp8": ["model.compute_dtype=bfloat16", "model.fp8=tensorwise"]}


def train(preset: str, steps: int, overrides: list[str], run_dir: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "llama_jax",
        "train",
        preset,
        f"train.steps={steps}",
        f"run.dir={run_dir}",
        "checkpoint.every_steps=0",
        *overrides,
    ]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed (exit {proc.returncode}): {' '.join(command)}\n{proc.stderr[-3000:]}")
    records = read_metrics(run_dir / "metrics.jsonl")
    return {
        "eval_loss": {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r},
        "loss": {r["step"]: r["loss"] for r in records if "loss" in r},
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records if r.get("tokens_per_s")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as work:
        runs = {
            name: train(args.preset, args.steps, [*settings, *args.overrides], Path(work) / name)
            for name, settings in RECIPES.items()
        }
    bf16, fp8 = runs["bf16"], runs["fp8"]
    last = max(bf16["eval_loss"])
    gap = (fp8["eval_loss"][last] - bf16["eval_loss"][last]) / bf16["eval_loss"][last]
    print(f"{args.preset} {' '.join(args.overrides)}: {args.steps} steps, same seed and data")
    print(f"  {'step':>6} {'eval loss bf16':>15} {'eval loss fp8':>14} {'fp8 / bf16 - 1':>15}")
    for step in sorted(bf16["eval_loss"]):
        a, b = bf16["eval_loss"][step], fp8["eval_loss"].get(step, float("nan"))
        print(f"  {step:>6} {a:>15.4f} {b:>14.4f} {100 * (b - a) / a:>14.2f}%")
    print(f"  tokens/s (CPU, fp8 emulated): bf16 {bf16['tokens_per_s']:.1f}, fp8 {fp8['tokens_per_s']:.1f}")
    result = {
        "preset": args.preset,
        "steps": args.steps,
        "overrides": args.overrides,
        "final_step": last,
        "final_relative_gap": gap,
        "eval_loss": {k: v["eval_loss"] for k, v in runs.items()},
        "tokens_per_s": {k: v["tokens_per_s"] for k, v in runs.items()},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
