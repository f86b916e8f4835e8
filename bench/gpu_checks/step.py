"""gpu-check's train step: planned, timed and profiled on one device, its rows beside plan's prediction."""

from __future__ import annotations

import dataclasses
import math
import shutil
import statistics
from pathlib import Path

import jax

from gpu_checks.table import Row, format_flops
from llama_jax.config import Config
from llama_jax.distributed import sharding
from llama_jax.files import cache_root, format_bytes
from llama_jax.model.attention import select_implementation
from llama_jax.model.llama import param_count
from llama_jax.perf.hardware import MfuPeaks, mfu_peaks
from llama_jax.perf.profile import profile_run
from llama_jax.perf.profiler import StepProfiler
from llama_jax.planning.plan import make_plan
from llama_jax.training.batches import put_batch
from llama_jax.training.program import TrainProgram
from llama_jax.training.timing import random_batch, time_train_steps

PROFILED_STEPS, PROFILE_TOP = 2, 12  # steps traced after each timed step's, and the ops its table lists
PREDICTION_TOLERANCE = 0.15  # plan's predicted step against the measured one (bench/gpu_prediction.py)
MFU_GOAL = 0.5  # the goal for an 8B-shaped bf16 step on one H100 (989 TFLOP/s data sheet); reported, not enforced


def measure_train_step(
    config: Config, steps: int, warmup: int, earlier: dict | None = None, profile_dir: Path | None = None
) -> dict:
    """Plan the step on one device, then time it: plan's figures next to the measured ones. After an `earlier`
    step's figures: MFU against the same compute peak (a CPU's is measured again on each call), and the device's
    peak memory in use, the process's high-water mark, which jax cannot reset, is this step's only where it rose
    above the earlier one's (None otherwise). With `profile_dir`, PROFILED_STEPS more steps are traced there after
    the timed ones (run.profile_steps' profiler: `llama-jax profile DIR` reads it) and summarised in "profile"."""
    devices = jax.devices()[:1]
    planned = make_plan(config, sharding.make_mesh(config, devices=devices))  # resolves microbatches=auto
    m, t = config.model, config.train
    figures = {
        "batch_size": t.batch_size,
        "seq_len": t.seq_len,
        "layers": m.n_layers,
        "parameters": param_count(m),
        "remat": config.remat.policy,
        "microbatches": planned.microbatches,
        "attention": select_implementation(
            m.attention, jax.default_backend(), m.compute_dtype, m.resolved_head_dim, t.seq_len
        ),
        "planned_total_bytes": planned.total_bytes,
        "budget_bytes": planned.budget_bytes,
        "hlo_flops": planned.hlo_flops,
        "model_flops": planned.model_flops,
        "predicted_step_s": planned.predicted_step_s,  # None where the device has no data sheet (a CPU)
        "fits": planned.total_bytes <= planned.budget_bytes,
    }
    if not figures["fits"]:
        return figures
    # The same program plan compiled: the persistent compilation cache hands its executable back, so the step
    # compiles once however many programs are built.
    config = with_microbatches(config, planned.microbatches)
    program = TrainProgram.for_config(config, devices=devices)
    with program.activate():
        state = program.init_state(jax.random.key(0))
        batch = put_batch(program, random_batch(config))
        times, metrics = time_train_steps(program, state, batch, steps, warmup)
        profile = profile_steps(program, batch, profile_dir) if profile_dir else None
    # The whole process's high-water mark, read before anything else allocates: the train step runs first.
    peak_bytes = (devices[0].memory_stats() or {}).get("peak_bytes_in_use")
    earlier_peak_bytes = (earlier or {}).get("peak_bytes_in_use")
    if earlier_peak_bytes and peak_bytes and peak_bytes <= earlier_peak_bytes:
        peak_bytes = None  # at most the earlier step's: not this step's own figure
    step_s = statistics.median(times)
    kind = devices[0].device_kind
    peaks = (
        MfuPeaks.with_fp8(earlier["peak_flops_per_device"], earlier["peak_source"], m.fp8, kind)
        if earlier
        else mfu_peaks(m.compute_dtype, m.fp8, cache_root(config.data.cache_dir))
    )
    achieved = planned.model_flops / step_s
    return {
        **figures,
        "compute_dtype": m.compute_dtype,
        "fp8": m.fp8,
        "fp8_flops": planned.fp8_flops,
        "steps": steps,
        "warmup": warmup,
        "step_s": times,
        "step_s_median": step_s,
        "tokens_per_s": t.batch_size * t.seq_len / step_s,
        "achieved_flops_per_s": achieved,
        "hlo_flops_per_s": planned.hlo_flops / step_s,
        "peak_flops_per_device": peaks.compute,
        "peak_source": peaks.compute_source,
        "fp8_peak_flops_per_device": peaks.fp8,
        "fp8_peak_source": peaks.fp8_source,
        **peaks.fractions(achieved, 1),
        "loss": float(metrics["loss"]),
        "finite": bool(metrics["finite"]),
        "peak_bytes_in_use": peak_bytes,
        "earlier_peak_bytes": earlier_peak_bytes,
        "profile": profile,
    }


def profile_steps(program: TrainProgram, batch, directory: Path) -> dict:
    """PROFILED_STEPS train steps from fresh weights (the timed steps donated theirs) traced into directory/profile,
    as run.profile_steps traces a run's, and `llama-jax profile directory`'s summary of them. The timed steps are
    not traced: tracing slows a step."""
    shutil.rmtree(directory / "profile", ignore_errors=True)  # profile_run reads the newest trace: this one
    state = program.init_state(jax.random.key(0))
    with StepProfiler(directory / "profile", 1, PROFILED_STEPS, lambda: program.compile_step().as_text()) as profiler:
        for step in range(1, PROFILED_STEPS + 1):
            state, _ = profiler.step(step, program.train_step, state, batch)
    return profile_run(directory, top=PROFILE_TOP)


def with_fp8(config: Config, recipe: str) -> Config:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, fp8=recipe))


def with_microbatches(config: Config, microbatches: int | str) -> Config:
    return dataclasses.replace(config, train=dataclasses.replace(config.train, microbatches=microbatches))


def with_layers(config: Config, layers: int) -> Config:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, n_layers=layers))


def prediction_row(area: str, f: dict) -> Row:
    """plan's predicted step (perf/costmodel.py, from the compiled step's operations) next to the measured one."""
    predicted = f["predicted_step_s"]
    if predicted is None:
        return Row(area, "predicted step", "info", "none", "plan predicts a step only on a GPU with a data sheet")
    ratio = predicted / f["step_s_median"]
    return Row(
        area,
        "predicted step",
        "info",
        f"{predicted:.3f} s",
        f"measured / predicted {1 / ratio:.3f}; goal: within {100 * PREDICTION_TOLERANCE:.0f}% "
        f"({'met' if abs(ratio - 1) <= PREDICTION_TOLERANCE else 'not met'})",
    )


def peak_memory_row(area: str, f: dict) -> Row:
    peak = f["peak_bytes_in_use"]
    planned = f"plan {format_bytes(f['planned_total_bytes'])}, budget {format_bytes(f['budget_bytes'])}"
    if peak:
        return Row(
            area,
            "peak device memory",
            "info",
            format_bytes(peak),
            f"{planned}; measured / plan {peak / f['planned_total_bytes']:.3f}",
        )
    if f.get("earlier_peak_bytes"):
        return Row(
            area,
            "peak device memory",
            "info",
            f"<= {format_bytes(f['earlier_peak_bytes'])}",
            f"{planned}; no higher than the step before it (jax cannot reset the process's high-water mark)",
        )
    return Row(
        area,
        "peak device memory",
        "skipped: no stats",
        "",
        f"the {jax.default_backend()} backend reports no device memory in use; {planned}",
    )


def train_rows(f: dict, preset: str, overrides: list[str]) -> list[Row]:
    parameters = f"{f['parameters'] / 1e9:.2f}B" if f["parameters"] >= 1e9 else f"{f['parameters'] / 1e6:.1f}M"
    shape = (
        f"{' '.join(overrides)}: {parameters} parameters, {f['batch_size']} x {f['seq_len']} tokens, "
        f"{f['microbatches']} micro-batch(es), remat {f['remat']}, attention {f['attention']}"
    )
    rows = [Row("train step", "model", "info", preset, shape)]
    if not f["fits"]:
        return rows + [
            Row(
                "train step",
                "fits one device",
                "FAIL",
                format_bytes(f["planned_total_bytes"]),
                f"plan's step is over this device's budget of {format_bytes(f['budget_bytes'])}; "
                "pass smaller sizes, e.g. model.n_layers=2",
            )
        ]
    ratio_hlo = f["hlo_flops"] / f["model_flops"]
    rows += [
        Row(
            "train step",
            "loss",
            "pass" if f["finite"] and math.isfinite(f["loss"]) else "FAIL",
            f"{f['loss']:.4f}",
            f"finite after {f['warmup'] + f['steps']} steps on random tokens",
        ),
        Row(
            "train step",
            "tokens/s",
            "info",
            f"{f['tokens_per_s']:,.0f}",
            f"median of {f['steps']} steps after {f['warmup']} warm-up: {f['step_s_median']:.3f} s/step",
        ),
        prediction_row("train step", f),
        Row(
            "train step",
            "MFU",
            "info",
            f"{100 * f['mfu']:.1f}%",
            f"model FLOP/s over {format_flops(f['peak_flops_per_device'])} ({f['peak_source']}); "
            f"goal on an H100: >= {100 * MFU_GOAL:.0f}%",
        ),
        Row(
            "train step",
            "achieved FLOP/s",
            "info",
            format_flops(f["achieved_flops_per_s"]),
            f"model FLOPs {f['model_flops']:.4g}/step; HLO FLOPs {f['hlo_flops']:.4g}/step = "
            f"{format_flops(f['hlo_flops_per_s'])}",
        ),
        Row(
            "train step",
            "HLO / model FLOPs",
            "info",
            f"{ratio_hlo:.3f}",
            "plan's compiled matmuls over 6 x params + attention per token (above 1: recomputation)",
        ),
    ]
    rows.append(peak_memory_row("train step", f))
    return rows
