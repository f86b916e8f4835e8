"""gpu-check's body: both steps again with twice the layers, and the marginal layer's time and MFU."""

from __future__ import annotations

import math

from gpu_checks.step import measure_train_step, with_fp8, with_layers, with_microbatches
from gpu_checks.table import Row, format_flops
from llama_jax.config import Config
from llama_jax.files import format_bytes
from llama_jax.perf.hardware import SHORT_DTYPE

BODY_MFU_GOAL, FP8_LAYERS_GOAL = 0.62, 1.4  # issue 44's goals for the marginal layer on one H100 or H200
BODY_DETAIL = "the steps above again with twice the layers: the marginal layer is what a 32-layer model's body runs at"


def body_section(config: Config, timed: dict[str, dict], steps: int, warmup: int) -> tuple[list[Row], dict]:
    """Each timed step (bf16, fp8) again with twice the layers: the marginal layer's time, and its MFU (the
    difference in model FLOPs over the difference in time: what the body of a 32-layer model runs at, without the
    embedding, output projection and loss). The deeper step takes the micro-batches its plan chooses; where that
    is more than the shallower step ran, the shallower one is timed again with as many, so that only the layers
    differ."""
    layers = 2 * config.model.n_layers
    rows, figures = [Row("body", "layers", "info", f"{config.model.n_layers} -> {layers}", BODY_DETAIL)], {}
    base = SHORT_DTYPE.get(config.model.compute_dtype, config.model.compute_dtype)  # bf16 on GPUs, fp32 on a CPU
    for name, recipe, label in (("step", "none", base), ("fp8_step", "tensorwise", "fp8")):
        shallow = timed.get(name) or {}
        if "step_s_median" not in shallow:
            rows.append(Row("body", f"marginal layer ({label})", "skipped: no step", "", "that step did not run"))
            continue
        in_recipe = with_fp8(config, recipe)
        deep = measure_train_step(with_microbatches(with_layers(in_recipe, layers), "auto"), steps, warmup, shallow)
        if deep["fits"] and deep["microbatches"] != shallow["microbatches"]:
            shallow = measure_train_step(with_microbatches(in_recipe, deep["microbatches"]), steps, warmup, shallow)
        figures[name] = marginal = marginal_layer(shallow, deep)
        rows.append(marginal_row(label, marginal, deep))
    if {"step", "fp8_step"} <= figures.keys() and min(figures[n].get("layer_s", 0) for n in figures) > 0:
        speedup = figures["step"]["layer_s"] / figures["fp8_step"]["layer_s"]
        figures["fp8_speedup_on_layers"] = speedup
        goal = f"goal on one H100 or H200: >= {FP8_LAYERS_GOAL:g}x"
        rows.append(Row("body", "fp8 speed-up on the layers", "info", f"{speedup:.2f}x", f"marginal layer; {goal}"))
    return rows, figures


def marginal_layer(shallow: dict, deep: dict) -> dict:
    if not deep["fits"]:
        return {"fits": False, "deep_total_bytes": deep["planned_total_bytes"], "budget_bytes": deep["budget_bytes"]}
    layers = deep["layers"] - shallow["layers"]
    layer_s = (deep["step_s_median"] - shallow["step_s_median"]) / layers
    layer_flops = (deep["model_flops"] - shallow["model_flops"]) / layers
    return {
        "fits": True,
        "microbatches": deep["microbatches"],
        "layer_s": layer_s,
        "layer_model_flops": layer_flops,
        "mfu": layer_flops / layer_s / shallow["peak_flops_per_device"] if layer_s > 0 else math.nan,
        "peak_flops_per_device": shallow["peak_flops_per_device"],
        "steps_s": [shallow["step_s_median"], deep["step_s_median"]],
        "predicted_layer_s": (deep["predicted_step_s"] - shallow["predicted_step_s"]) / layers
        if deep["predicted_step_s"] and shallow["predicted_step_s"]
        else None,
    }


def marginal_row(name: str, marginal: dict, deep: dict) -> Row:
    if not marginal["fits"]:
        over = f"{format_bytes(marginal['deep_total_bytes'])} > the budget, {format_bytes(marginal['budget_bytes'])}"
        return Row("body", f"marginal layer ({name})", "skipped: does not fit", "", f"{deep['layers']} layers: {over}")
    if not marginal["layer_s"] > 0:  # timing noise on a small step (the CPU smoke run's): nothing to report
        return Row("body", f"marginal-layer MFU ({name})", "info", "n/a", "the deeper step was not slower")
    shallow_s, deep_s = marginal["steps_s"]
    return Row(
        "body",
        f"marginal-layer MFU ({name})",
        "info",
        f"{100 * marginal['mfu']:.1f}%",
        f"{1e3 * marginal['layer_s']:.2f} ms per layer ({shallow_s:.3f} -> {deep_s:.3f} s/step at "
        f"{marginal['microbatches']} micro-batch(es)) over {format_flops(marginal['peak_flops_per_device'])}"
        + (f"; predicted {1e3 * marginal['predicted_layer_s']:.2f} ms" if marginal["predicted_layer_s"] else "")
        + (f"; goal on one H100 or H200: >= {100 * BODY_MFU_GOAL:.0f}%" if name == "bf16" else ""),
    )
