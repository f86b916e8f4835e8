"""GPU acceptance in one command: attention parity, an 8B-shaped train step and the settings in force, as one table.

    make gpu-check [ARGS="--json PATH --steps 20 key=value ..."]     # sources launch/gpu_env.sh first
    .venv/bin/python bench/gpu_check.py [--cpu-smoke] [--json PATH] [--steps N] [--warmup N] [--loss-steps N]
                                        [--preset P] [key=value ...]

On an NVIDIA GPU it checks, on one device:
1. attention parity: each path of llama_jax.model.attention (cuDNN plain causal, cuDNN's packed layout, the exact
   fallback for rows with more documents than model.attention_max_segments, the blocked kernel, XLA's kernel,
   and context parallelism over 4 devices simulated on this one: cuDNN's padded calls combined by log-sum-exp) on
   packed documents with GQA in bf16, output and gradients against an fp32 XLA reference, each within
   BF16_TOLERANCE of the reference's largest magnitude. tests/test_gpu.py runs the same cases.
2. the train step of Llama 3 8B's shape (its widths, vocabulary and 8,192-token rows) with 4 of its 32 layers and
   4 rows: the fp32 weights and AdamW moments of its 1.92B parameters take 21.5 GiB, and the whole step fits the
   ~72 GiB that launch/gpu_env.sh lets XLA allocate on an 80 GB GPU (docs/performance.md measured this size on
   one H100: 69.99 GiB; `llama-jax plan` on one CPU device predicts 66.16 GiB with 2 micro-batches). `plan`
   picks the micro-batches (the preset's microbatches=auto), then --steps timed steps after --warmup: tokens/s,
   MFU, peak device memory next to plan's prediction, and plan's HLO FLOPs next to the model FLOPs.
3. the same step with fp8 projections (model.fp8=tensorwise): tokens/s and its ratio to the bf16 step's (the goal
   on one H100: >= FP8_SPEEDUP_GOAL), MFU against the bf16 peak (comparable with the bf16 row and other frameworks)
   and the fp8 peak, peak device memory; then --loss-steps steps of each from the same initial weights on the
   bundled plays (a new batch each step), their losses side by side: the fp8 curve's last LOSS_TAIL steps within
   FP8_LOSS_TOLERANCE of bf16's.
4. the body: both steps again with twice the layers, and the marginal layer's time and MFU (the difference in
   model FLOPs over the difference in time: what a 32-layer model's body runs at, without the embedding, output
   projection and loss), with fp8's speed-up on the layers; goals on one H100 or H200: BODY_MFU_GOAL in bf16,
   FP8_LAYERS_GOAL for fp8.
5. the environment: XLA_FLAGS, whether launch/gpu_env.sh was applied, versions, device, CUDA and cuDNN.

Each timed step's row shows plan's predicted step beside the measured one (on a GPU with a data sheet), and
PROFILED_STEPS more steps of each are traced after the timed ones (into the --json path without its suffix,
e.g. runs/gpu_check/step/profile/): `llama-jax profile`'s table of each is printed after the check's table.

Without an NVIDIA GPU it prints one line and exits 0. --cpu-smoke runs the same code on the CPU with small shapes
(the tiny preset; rows that need cuDNN say they were skipped). Exit status 1 when any row failed. The figures are
also written as JSON (--json, default runs/gpu_check.json). Each section is a module of bench/gpu_checks/: attention,
step, fp8, body, environment, and the table they fill.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import jax
from gpu_checks.attention import GPU_SHAPE, SMOKE_SHAPE, attention_section
from gpu_checks.body import body_section
from gpu_checks.environment import environment_section, no_gpu_reason
from gpu_checks.fp8 import fp8_section
from gpu_checks.step import measure_train_step, train_rows
from gpu_checks.table import Row, first_line, format_table

from llama_jax.config import load_config
from llama_jax.errors import EXIT_BAD_INPUT, ConfigError
from llama_jax.perf.hardware import SHORT_DTYPE
from llama_jax.perf.profile import format_profile
from llama_jax.training.run import enable_compilation_cache

DEFAULT_JSON = Path("runs") / "gpu_check.json"
NO_GPU = "gpu-check: no NVIDIA GPU here ({reason}); nothing to check"
GPU_PRESET, GPU_OVERRIDES = "llama3_8b", ["model.n_layers=4", "train.batch_size=4"]
SMOKE_PRESET, SMOKE_OVERRIDES = "tiny", ["train.batch_size=4"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="run every check on the CPU with small shapes (a test of this script, not of a GPU)",
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"write the figures here ({DEFAULT_JSON})")
    parser.add_argument("--steps", type=int, help="timed train steps (default 20; 3 with --cpu-smoke)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed train steps first (compilation, autotuning)")
    parser.add_argument(
        "--loss-steps", type=int, help="steps of the bf16 and fp8 loss curves (default 50; 5 with --cpu-smoke)"
    )
    parser.add_argument("--preset", help=f"the train step's preset ({GPU_PRESET}; {SMOKE_PRESET} with --cpu-smoke)")
    defaults = f"{' '.join(GPU_OVERRIDES)}; {' '.join(SMOKE_OVERRIDES)} with --cpu-smoke"
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=f"after the defaults ({defaults})")
    args = parser.parse_args(argv)
    if (
        (args.steps is not None and args.steps < 1)
        or args.warmup < 0
        or (args.loss_steps is not None and args.loss_steps < 1)
    ):
        print("gpu-check: error: --steps and --loss-steps must be at least 1 and --warmup at least 0", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")  # before jax picks a backend
    elif reason := no_gpu_reason():
        print(NO_GPU.format(reason=reason))
        return 0
    preset = args.preset or (SMOKE_PRESET if args.cpu_smoke else GPU_PRESET)
    overrides = [*(SMOKE_OVERRIDES if args.cpu_smoke else GPU_OVERRIDES), *args.overrides]
    steps = args.steps if args.steps is not None else (3 if args.cpu_smoke else 20)
    loss_steps = args.loss_steps if args.loss_steps is not None else (5 if args.cpu_smoke else 50)
    try:
        config = load_config(preset, overrides)
    except ConfigError as error:
        print(f"gpu-check: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    enable_compilation_cache(config)  # before the first compilation, so that every one can use it
    described = f"{preset} {' '.join(overrides)}"
    log = lambda message: print(f"gpu-check: {message}", file=sys.stderr, flush=True)  # noqa: E731
    profiles = args.json.with_suffix("")  # runs/gpu_check/{step,fp8_step}/profile: each timed step's trace

    environment_rows, environment = environment_section()
    # The train step first, so the device's peak memory in use is the step's and not the parity checks'.
    log(f"planning and timing the train step of {described} ({args.warmup} + {steps} steps)")
    try:
        train = measure_train_step(config, steps, args.warmup, profile_dir=profiles / "step")
        step_rows = train_rows(train, preset, overrides)
    except Exception as error:  # an out-of-memory or compiler error is a failed row; the attention rows still run
        train = {"error": first_line(error)}
        step_rows = [Row("train step", "model", "FAIL", preset, f"{' '.join(overrides)}: {first_line(error)}")]
    log(f"the same step with fp8 projections ({args.warmup} + {steps} steps), then {loss_steps} steps of each")
    try:
        fp8_step_rows, fp8 = fp8_section(config, train, steps, args.warmup, loss_steps, profiles / "fp8_step")
    except Exception as error:  # as for the bf16 step: a failed row, and the other rows still run
        fp8 = {"error": first_line(error)}
        fp8_step_rows = [Row("fp8 step", "model", "FAIL", "model.fp8=tensorwise", first_line(error))]
    log(f"both steps again with {2 * config.model.n_layers} layers: the marginal layer")
    try:
        body_rows, body = body_section(config, {"step": train, "fp8_step": fp8}, steps, args.warmup)
    except Exception as error:  # as above
        body = {"error": first_line(error)}
        body_rows = [Row("body", "layers", "FAIL", "", first_line(error))]
    log("attention parity against the fp32 reference")
    # Past no_gpu_reason(), only --cpu-smoke runs without cuDNN.
    attention_rows, parity = attention_section(SMOKE_SHAPE if args.cpu_smoke else GPU_SHAPE, not args.cpu_smoke)

    rows = [*attention_rows, *step_rows, *fp8_step_rows, *body_rows, *environment_rows]
    counts = {s: sum(r.status.startswith(s) for r in rows) for s in ("pass", "FAIL", "skipped")}
    print(
        f"gpu-check{' --cpu-smoke' if args.cpu_smoke else ''} on {jax.devices()[0].device_kind}: "
        f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skipped']} skipped"
    )
    print(format_table(rows))
    for name, figures in (("step", train), ("fp8_step", fp8)):
        if figures.get("profile"):
            label = "fp8" if figures["fp8"] != "none" else SHORT_DTYPE.get(figures["compute_dtype"], "the")
            print(f"\nwhere the {label} step's time went (llama-jax profile {profiles / name}):")
            print(format_profile(figures["profile"]))
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "passed": counts["pass"],
        "failed": counts["FAIL"],
        "skipped": counts["skipped"],
        "rows": [dataclasses.asdict(r) for r in rows],
        "attention": parity,
        "train_step": {"preset": preset, "overrides": overrides, **train},
        "fp8_step": fp8,
        "body": body,
        "environment": environment,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"figures: {args.json}")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
