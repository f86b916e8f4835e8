"""gpu-check's fp8 step: tokens/s against the bf16 step's, and the two loss curves from the same weights."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax

from gpu_checks.step import measure_train_step, peak_memory_row, prediction_row, with_fp8, with_microbatches
from gpu_checks.table import Row, format_flops
from llama_jax.config import Config
from llama_jax.data.streams import open_data
from llama_jax.files import format_bytes
from llama_jax.perf.hardware import SHORT_DTYPE
from llama_jax.training.batches import put_batch
from llama_jax.training.program import TrainProgram

FP8_SPEEDUP_GOAL = 1.3  # fp8 tokens/s over bf16's for the same step on one H100 (issue 35); reported, not enforced
# The fp8 loss curve's end against bf16's: the mean train loss of the last LOSS_TAIL steps within 2%, the bound the
# issue sets for the bench preset's eval loss after 300 steps on CPU (bench/fp8_loss.py). A failed row, not a goal.
FP8_LOSS_TOLERANCE, LOSS_TAIL = 0.02, 10


def loss_curve(config: Config, steps: int) -> list[float]:
    """The loss of each of `steps` train steps on one device from the initial weights of key 0, a new batch of the
    bundled plays each step (data.sources=[shakespeare], with a byte-level BPE of the model's vocabulary trained on
    them once into the data cache): real text, whose loss falls over hundreds of steps, so fp8's rounding shows as
    a gap between the curves. (One batch of random tokens, the timing's, is learnt by heart: on an H200 the 8B-shaped
    step took it from 12.6 to 0.0003 in 6 steps, and the two curves then differed only in noise.) The learning-rate
    warm-up is shortened to a fifth of the steps (the presets' run to hundreds of steps, over which these would
    barely move the weights)."""
    warmup = min(config.train.warmup_steps, max(1, steps // 5))
    plays = dataclasses.replace(config.data, sources=["shakespeare"], tokenizer="bpe", weights=[])
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, warmup_steps=warmup), data=plays)
    text = open_data(config, print_fn=lambda message: None).train
    program = TrainProgram.for_config(config, devices=jax.devices()[:1])
    losses = []
    with program.activate():
        state = program.init_state(jax.random.key(0))
        for step in range(steps):
            state, metrics = program.train_step(state, put_batch(program, text.batch(step)))
            losses.append(float(metrics["loss"]))
    return losses


def loss_gap(bf16: list[float], fp8: list[float]) -> tuple[float, float]:
    """(the fp8 curve's mean loss over the last LOSS_TAIL steps relative to the bf16 curve's: what FP8_LOSS_TOLERANCE
    bounds, the largest relative difference of one step: early steps, where the loss falls fastest, differ most)."""
    tail = min(LOSS_TAIL, len(bf16))
    mean = lambda losses: sum(losses[-tail:]) / tail  # noqa: E731
    return abs(mean(fp8) - mean(bf16)) / mean(bf16), max(abs(b - f) / b for b, f in zip(bf16, fp8))


def fp8_section(
    config: Config, bf16: dict, steps: int, warmup: int, loss_steps: int, profile_dir: Path | None = None
) -> tuple[list[Row], dict]:
    """The bf16 train step's row again with model.fp8=tensorwise, and both steps' losses side by side."""
    if config.model.fp8 != "none":
        return [
            Row(
                "fp8 step",
                "model",
                "skipped: fp8 already on",
                f"model.fp8={config.model.fp8}",
                "the train step above is the fp8 one; pass model.fp8=none to compare it with bf16",
            )
        ], {}
    if "tokens_per_s" not in bf16:
        return [
            Row(
                "fp8 step",
                "model",
                "skipped: no bf16 step",
                "model.fp8=tensorwise",
                "the bf16 train step above did not run: nothing to compare with",
            )
        ], {}
    fp8 = measure_train_step(with_fp8(config, "tensorwise"), steps, warmup, bf16, profile_dir)
    if not fp8["fits"]:
        return fp8_rows(fp8, bf16), fp8
    # Each with the micro-batches its plan chose for the timed steps: the same programs, compiled once.
    losses = {
        recipe: loss_curve(with_fp8(with_microbatches(config, figures["microbatches"]), recipe), loss_steps)
        for recipe, figures in (("none", bf16), ("tensorwise", fp8))
    }
    finite = all(map(math.isfinite, losses["none"] + losses["tensorwise"]))
    tail, largest = loss_gap(losses["none"], losses["tensorwise"]) if finite else (math.nan, math.nan)
    figures = {
        **fp8,
        "tokens_per_s_ratio": fp8["tokens_per_s"] / bf16["tokens_per_s"],
        "loss_steps": loss_steps,
        "loss_bf16": losses["none"],
        "loss_fp8": losses["tensorwise"],
        "loss_tail_steps": min(LOSS_TAIL, loss_steps),
        "loss_tail_relative_difference": tail,
        "loss_max_relative_difference": largest,
    }
    return fp8_rows(figures, bf16), figures


def fp8_rows(f: dict, bf16: dict) -> list[Row]:
    base = f"{SHORT_DTYPE.get(bf16['compute_dtype'], bf16['compute_dtype'])} step"  # bf16 on GPUs, fp32 on a CPU
    in_fp8 = (
        f"fp8 operands in {100 * f['fp8_flops'] / f['hlo_flops']:.0f}% of the compiled step's HLO FLOPs"
        if f["fp8_flops"]
        else f"the {jax.default_backend()} compiler computes them in a wider type"
    )
    rows = [
        Row(
            "fp8 step",
            "model",
            "info",
            "model.fp8=tensorwise",
            f"the train step above with its 7 projections' matmuls in fp8: {in_fp8}",
        )
    ]
    if not f["fits"]:
        return rows + [
            Row(
                "fp8 step",
                "fits one device",
                "FAIL",
                format_bytes(f["planned_total_bytes"]),
                f"plan's step is over this device's budget of {format_bytes(f['budget_bytes'])}",
            )
        ]
    fp8_mfu = (
        f"{100 * f['mfu_fp8']:.1f}% of {format_flops(f['fp8_peak_flops_per_device'])} ({f['fp8_peak_source']})"
        if f["mfu_fp8"] is not None
        else f["fp8_peak_source"]
    )
    curve = lambda losses: " ".join(f"{x:.3f}" for x in losses[:: max(1, len(losses) // 5)])  # noqa: E731
    rows += [
        Row(
            "fp8 step",
            "loss",
            "pass" if f["finite"] and math.isfinite(f["loss"]) else "FAIL",
            f"{f['loss']:.4f}",
            f"finite after {f['warmup'] + f['steps']} steps on random tokens",
        ),
        Row(
            "fp8 step",
            "tokens/s",
            "info",
            f"{f['tokens_per_s']:,.0f}",
            f"{f['tokens_per_s_ratio']:.2f}x the {base}'s {bf16['tokens_per_s']:,.0f}; goal on one H100: >= "
            f"{FP8_SPEEDUP_GOAL:g}x",
        ),
        prediction_row("fp8 step", f),
        Row(
            "fp8 step",
            "MFU",
            "info",
            f"{100 * f['mfu']:.1f}%",
            f"model FLOP/s over the {base}'s {format_flops(f['peak_flops_per_device'])}; fp8: {fp8_mfu}",
        ),
        peak_memory_row("fp8 step", f),
        Row(
            "fp8 step",
            "loss vs bf16",
            "pass" if f["loss_tail_relative_difference"] <= FP8_LOSS_TOLERANCE else "FAIL",
            f"{100 * f['loss_tail_relative_difference']:.2f}%",
            f"|fp8 - {base}| / {base}, mean loss of the last {f['loss_tail_steps']} of {f['loss_steps']} steps on the "
            f"bundled plays from the same weights, pass <= {100 * FP8_LOSS_TOLERANCE:g}% (largest of one step "
            f"{100 * f['loss_max_relative_difference']:.2f}%); {base} {curve(f['loss_bf16'])}, "
            f"fp8 {curve(f['loss_fp8'])}",
        ),
    ]
    return rows
