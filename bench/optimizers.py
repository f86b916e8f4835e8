"""AdamW against Muon (train.optimizer), each at its best learning rate of a small sweep, on this CPU: the same
data (Shakespeare, the same batches), the same steps, on two shapes: the `bench` preset and a wider one (the
`tiny` preset at twice its width). Prints eval loss against steps and against training time, and the tokens AdamW
needs to reach Muon's final eval loss.

    .venv/bin/python bench/optimizers.py [--lrs 1e-3,3e-3,1e-2] [--json out.json] [--plot out.png]

Method:
- Each (shape, optimizer, learning rate) trains from the same seed in a fresh run.dir under --work, evaluating
  every --eval-every steps on the same held-out batches (train.eval_batches); the schedule is each preset's
  (warmup 10% of the steps, cosine to 10%).
- The best learning rate of each optimizer is the one with the lowest final eval loss.
- Training time at a step: the step times the run logged (train.log_every windows), summed; compile and evaluation
  left out, so the two optimizers' time columns compare the cost of their steps alone.
- Tokens to reach: the first eval step at which AdamW's best run is at or below Muon's best final eval loss,
  linearly interpolated between evals, times the tokens per step; "not reached" when it never gets there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (preset, overrides): a batch of 8 x 256 tokens keeps each of the sweep's runs near two minutes here.
SHAPES = {
    "bench": ("bench", ["train.steps=60", "train.seq_len=256", "train.batch_size=8"]),
    "wide": (
        "tiny",
        [
            "train.steps=150",
            "model.d_model=384",
            "model.ffn_dim=1152",
            "model.n_heads=8",
            "model.n_kv_heads=4",
        ],
    ),
}
OPTIMIZERS = ("adamw", "muon")


def run_once(preset: str, overrides: list[str], run_dir: Path) -> dict:
    """One training run; its eval losses and training time by step, and its throughput."""
    from llama_jax.api import train
    from llama_jax.training.metrics import read_metrics

    shutil.rmtree(run_dir, ignore_errors=True)
    summary = train(preset, [*overrides, f"run.dir={run_dir}"], print_fn=lambda *_: None)
    records = read_metrics(run_dir / "metrics.jsonl")
    elapsed, last, clock = 0.0, 0, {0: 0.0}
    for r in records:
        if "loss" in r and r.get("step_time_s"):
            elapsed += r["step_time_s"] * (r["step"] - last)
        if "loss" in r:
            last = r["step"]
            clock[r["step"]] = elapsed
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    return {
        "eval_loss": evals,
        "train_s": {step: clock.get(step, elapsed) for step in evals},
        "tokens_per_s": summary.get("tokens_per_s"),
    }


def tokens_to_reach(target: float, evals: dict[int, float], tokens_per_step: int) -> float | None:
    """Tokens at which the eval curve first reaches `target`, interpolated between evals; None if it never does."""
    steps = sorted(evals)
    for before, after in zip(steps, steps[1:]):
        if evals[after] <= target:
            drop = evals[before] - evals[after]
            fraction = (evals[before] - target) / drop if drop > 0 else 1.0
            return (before + fraction * (after - before)) * tokens_per_step
    return None


def measure(args) -> dict:
    from llama_jax.config import load_config

    results = {}
    for shape, (preset, overrides) in SHAPES.items():
        common = [*overrides, f"train.eval_every={args.eval_every}", "train.sample_tokens=0", "train.log_every=5"]
        config = load_config(preset, common)
        tokens_per_step = config.train.batch_size * config.train.seq_len
        runs = {}
        for optimizer in OPTIMIZERS:
            for lr in args.lrs:
                name = f"{shape}-{optimizer}-{lr:g}"
                runs[optimizer, lr] = run_once(
                    preset, [*common, f"train.optimizer={optimizer}", f"train.lr={lr}"], args.work / name
                )
                final = runs[optimizer, lr]["eval_loss"][config.train.steps]
                print(f"  {name:<24} final eval loss {final:.4f}", flush=True)
        best = {
            o: min((lr for lr in args.lrs), key=lambda lr: runs[o, lr]["eval_loss"][config.train.steps])
            for o in OPTIMIZERS
        }
        muon_final = runs["muon", best["muon"]]["eval_loss"][config.train.steps]
        results[shape] = {
            "preset": preset,
            "overrides": overrides,
            "params": _params(config),
            "tokens_per_step": tokens_per_step,
            "steps": config.train.steps,
            "best_lr": best,
            "sweep": {f"{o} {lr:g}": runs[o, lr]["eval_loss"][config.train.steps] for o, lr in runs},
            "curves": {o: runs[o, best[o]] for o in OPTIMIZERS},
            "adamw_tokens_to_muon_final": tokens_to_reach(
                muon_final, runs["adamw", best["adamw"]]["eval_loss"], tokens_per_step
            ),
        }
    return results


def _params(config) -> int:
    from llama_jax.model.llama import param_count

    return param_count(config.model)


def report(results: dict) -> str:
    lines = []
    for shape, r in results.items():
        curves = r["curves"]
        lines.append(
            f"{shape}: {r['preset']} {' '.join(r['overrides'])} ({r['params'] / 1e6:.1f}M params, "
            f"{r['tokens_per_step']} tokens/step)"
        )
        lines.append("  sweep (final eval loss): " + ", ".join(f"{k} {v:.4f}" for k, v in r["sweep"].items()))
        lines.append(f"  {'step':>6}" + "".join(f"{o + ' ' + format(r['best_lr'][o], 'g'):>24}" for o in curves))
        lines.append(f"  {'':>6}" + "".join(f"{'eval loss   train s':>24}" for _ in curves))
        for step in sorted(curves["adamw"]["eval_loss"]):
            lines.append(
                f"  {step:>6}"
                + "".join(f"{c['eval_loss'][step]:>14.4f}{c['train_s'][step]:>10.1f}" for c in curves.values())
            )
        lines.append(
            "  tokens/s: " + ", ".join(f"{o} {c['tokens_per_s']:,.0f}" for o, c in curves.items() if c["tokens_per_s"])
        )
        reach = r["adamw_tokens_to_muon_final"]
        muon_tokens = r["steps"] * r["tokens_per_step"]
        lines.append(
            f"  AdamW reaches Muon's final eval loss after {reach:,.0f} tokens ({reach / muon_tokens:.2f}x Muon's "
            f"{muon_tokens:,})"
            if reach
            else f"  AdamW does not reach Muon's final eval loss within the run's {muon_tokens:,} tokens"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(results), 2, figsize=(10, 4 * len(results)), squeeze=False)
    for row, (shape, r) in enumerate(results.items()):
        for optimizer, curve in r["curves"].items():
            steps = sorted(curve["eval_loss"])
            label = f"{optimizer} lr {r['best_lr'][optimizer]:g}"
            losses = [curve["eval_loss"][s] for s in steps]
            axes[row][0].plot(steps, losses, marker="o", label=label)
            axes[row][1].plot([curve["train_s"][s] for s in steps], losses, marker="o", label=label)
        axes[row][0].set(title=f"{shape}: eval loss by step", xlabel="step", ylabel="eval loss")
        axes[row][1].set(title=f"{shape}: eval loss by training time", xlabel="seconds (this CPU)")
        for ax in axes[row]:
            ax.legend()
            ax.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lrs", type=lambda s: [float(v) for v in s.split(",")], default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        args.work = args.work or Path(scratch)
        results = measure(args)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
