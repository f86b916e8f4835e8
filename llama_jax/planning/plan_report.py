"""What `llama-jax plan` prints of a Plan (plan.py): the per-device memory, FLOPs, collectives and pipeline
stages as text, the same as JSON, a staged run's plans with what they add up to, the remat policies side by side,
and what a hang report says of a running program (its plan, compiled again).
"""

from __future__ import annotations

import dataclasses
import json
import math

from llama_jax.config.stages import Stage
from llama_jax.files import format_bytes
from llama_jax.perf import xla_log
from llama_jax.planning.plan import Plan, make_plan
from llama_jax.training.program import TrainProgram


def format_remat_comparison(plans: dict[str, Plan]) -> str:
    """Per-device temporaries and total memory, and HLO FLOPs, each also relative to `none`."""
    base = plans["none"]
    lines = [
        (
            f"{'policy':<22}{'temporaries':>13}{'vs none':>9}{'total':>13}{'host':>12}{'HLO FLOPs':>12}"
            f"{'vs none':>9}{'vs model':>10}"
        )
    ]
    for name, p in plans.items():
        lines.append(
            f"{name:<22}{format_bytes(p.temporary_bytes):>13}{p.temporary_bytes / base.temporary_bytes:>9.3f}"
            f"{format_bytes(p.total_bytes):>13}{format_bytes(p.host_temporary_bytes):>12}{p.hlo_flops:>12.4g}"
            f"{p.hlo_flops / base.hlo_flops:>9.3f}{p.hlo_flops / p.model_flops:>10.3f}"
        )
    return "\n".join(lines)


def describe_program(program: TrainProgram) -> str:
    """What a hang report says of a running program (training's watchdog): its plan, compiled again, as text."""
    return format_plan(make_plan(program.config, program.mesh))


def format_plan(plan: Plan) -> str:
    stages = plan.mesh.get("pipeline", 1)
    lines = _memory_and_flops_lines(plan, stages)
    if plan.predicted_step_s is not None:
        against = f"MFU {plan.predicted_mfu:.1%}" + (
            f", {plan.predicted_mfu_fp8:.1%} of the fp8 peak" if plan.predicted_mfu_fp8 is not None else ""
        )
        fp8 = ", fp8 matmuls at the fp8 peak" if plan.fp8_flops else ""
        lines.append(
            f"predicted step {plan.predicted_step_s * 1e3:10.1f} ms   ({against}; llama-jax tune's cost "
            f"model{fp8}; {plan.peaks})"
        )
    lines += _collective_lines(plan, stages)
    if stages > 1:
        lines += _pipeline_lines(plan, stages)
    if plan.rematerialized:
        lines.append(xla_log.describe(plan.rematerialized))
    return "\n".join(line for line in lines if line)


def _memory_and_flops_lines(plan: Plan, stages: int) -> list[str]:
    """The plan's header, per-device memory, FLOPs per step and memory traffic (empty lines: left out)."""
    return [
        f"mesh {plan.mesh} on {plan.devices} {plan.target or 'device(s)'} in {plan.hosts} host(s), compiled in "
        f"{plan.compile_seconds:.1f}s",
        "per device memory:" if stages == 1 else "per device memory (one pipeline stage):",
        f"  arguments    {format_bytes(plan.argument_bytes):>12}   (train state + batch)",
        f"  temporaries  {format_bytes(plan.temporary_bytes):>12}   (activations, gradients, scratch)",
        f"  outputs      {format_bytes(plan.output_bytes):>12}   (not aliased to donated arguments)",
        f"  cuDNN        {format_bytes(plan.cudnn_workspace_bytes):>12}   (attention's workspace, estimated from "
        "an H100's: a compile without the GPU does not size it)"
        if plan.target
        else "",
        f"  total        {format_bytes(plan.total_bytes):>12}   "
        f"({'fits' if plan.total_bytes <= plan.budget_bytes else 'OVER'} the budget of "
        f"{format_bytes(plan.budget_bytes)}, run.device_memory_gb; {plan.microbatches} "
        f"micro-batch{'es' if plan.microbatches > 1 else ''})",
        f"  host         {format_bytes(plan.host_temporary_bytes):>12}   (offloaded to pinned host memory)"
        if plan.host_temporary_bytes
        else "",
        "FLOPs per step (all devices):",
        f"  HLO          {plan.hlo_flops:12.4g}   (matmuls of the compiled program, every layer counted)",
        f"  model        {plan.model_flops:12.4g}   (6 x matmul params (4 x frozen ones) + attention, "
        "per token x tokens)",
        f"  HLO / model  {plan.hlo_flops / plan.model_flops:12.3f}   (above 1: recomputation or replicated work)",
        f"  fp8          {plan.fp8_flops:12.4g}   ({plan.fp8_flops / (plan.hlo_flops or 1):.1%} of HLO: matmuls with "
        f"fp8 operands, model.fp8={plan.fp8}"
        f"{'' if plan.fp8_flops else '; this compiler computes them in a wider type'})"
        if plan.fp8 != "none" or plan.fp8_flops
        else "",
        f"memory traffic {format_bytes(plan.memory_traffic_bytes):>11}   (per device: bytes operations read and write)",
    ]


def _collective_lines(plan: Plan, stages: int) -> list[str]:
    """Collective bytes per device per step: by kind, against the analytic minimum, by mesh axes and link tier."""
    ratio = plan.collective_total / plan.minimum_total if plan.minimum_total else math.nan
    lines = ["collectives per device per step (ring cost model):"]
    lines += [
        f"  {kind:<19}{format_bytes(b):>12}"
        + ("   (point to point: the pipeline)" if kind == "collective-permute" and stages > 1 else "")
        for kind, b in plan.collective_bytes.items()
    ]
    lines.append(f"  {'total':<19}{format_bytes(plan.collective_total):>12}")
    lines.append(
        f"  {'of it the optimizer':<19}{format_bytes(plan.optimizer_collective_bytes):>12}   "
        f"({plan.optimizer}'s update"
        + (": each matrix moved whole for Newton-Schulz, and back)" if plan.optimizer == "muon" else ")")
    )
    minimum = ", ".join(f"{k} {format_bytes(v)}" for k, v in plan.collective_minimum.items() if v)
    lines.append(f"  analytic minimum {format_bytes(plan.minimum_total):>12}   ({minimum or 'no communication'})")
    lines.append(f"  measured / minimum {ratio:10.2f}" if plan.minimum_total else "")
    if plan.collective_by_axis:
        lines.append("collectives by the mesh axes their device groups span, per device per step:")
        lines.append(f"  {'axes':<26}{'kind':<20}{'tier':<12}{'bytes':>12}")
        lines += [
            f"  {'×'.join(t.axes) or '-':<26}{t.kind:<20}{t.tier:<12}{format_bytes(t.bytes):>12}"
            for t in plan.collective_by_axis
        ]
        tiers = ", ".join(f"{tier} {format_bytes(b)}" for tier, b in plan.collective_tiers.items())
        lines.append(f"  {'total':<58}{format_bytes(plan.collective_total):>12}   ({tiers})")
    return lines


def _pipeline_lines(plan: Plan, stages: int) -> list[str]:
    """A pipeline's schedule, its bubble (in theory and as compiled), and each stage's layers and memory."""
    passes = plan.microbatches // plan.pass_microbatches
    lines = [
        f"pipeline ({plan.schedule}): {stages} stages x {plan.pipeline_repeats} repeat(s) over "
        f"{plan.pass_microbatches} micro-batches per pass{f', {passes} passes' if passes > 1 else ''}: "
        f"bubble {plan.bubble:.1%} of the step ((P-1)/(M·R+P-1))"
    ]
    if plan.compiled_bubble is not None:
        turns = plan.pass_microbatches * plan.pipeline_repeats
        how = (
            f"each stage's {turns} forward and {turns} backward passes, V-1 = "
            f"{stages * plan.pipeline_repeats - 1} iterations at each end running one kind only"
            if plan.schedule == "1f1b"
            else f"{turns} micro-batch turns per stage"
        )
        lines.append(
            f"  compiled: the stage loop runs {plan.pipeline_iterations} iterations for {how}: bubble "
            f"{plan.compiled_bubble:.1%}"
        )
    group = " groups of layers" if plan.pipeline_repeats > 1 else ""
    lines.append(
        f"  {'stage':>7}{'layers':>8}{'in flight':>11}{'memory':>12}   (micro-batch{group} kept at once; "
        "memory per device)"
    )
    lines += [
        f"  {p:>7}{n:>8}{k:>11}{format_bytes(b):>12}"
        for p, (n, k, b) in enumerate(zip(plan.stage_layers, plan.in_flight, plan.stage_bytes))
    ]
    return lines


def plan_dict(plan: Plan) -> dict:
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "operations"}
    fields["collective_by_axis"] = [dataclasses.asdict(t) for t in plan.collective_by_axis]
    return {
        **fields,
        "collective_total": plan.collective_total,
        "minimum_total": plan.minimum_total,
        "collective_tiers": plan.collective_tiers,
    }


def plan_json(plan: Plan) -> str:
    return json.dumps(plan_dict(plan), indent=2)


def stages_summary(stages: list[Stage], plans: list[Plan]) -> dict:
    """What the stages add up to: steps, tokens, predicted time (where the plans predict a step), and the stage
    whose memory is the largest, which decides whether the run fits."""
    largest = max(range(len(plans)), key=lambda i: plans[i].total_bytes)
    predicted = [p.predicted_step_s for p in plans]
    return {
        "stages": len(stages),
        "steps": sum(s.steps for s in stages),
        "tokens": sum(s.steps * s.tokens_per_step for s in stages),
        "predicted_time_s": None if None in predicted else sum(s.steps * t for s, t in zip(stages, predicted)),
        "largest_memory_stage": largest + 1,
        "largest_total_bytes": plans[largest].total_bytes,
        "fits": all(p.total_bytes <= p.budget_bytes for p in plans),
    }


def format_stage_plans(stages: list[Stage], plans: list[Plan]) -> str:
    summary = stages_summary(stages, plans)
    blocks = [f"{stage.describe()}\n" + format_plan(plan) for stage, plan in zip(stages, plans)]
    hours = summary["predicted_time_s"]
    blocks.append(
        f"{summary['stages']} stages: {summary['steps']:,} steps, {summary['tokens']:,} tokens"
        + (f", predicted {hours / 3600:,.1f} h of steps" if hours is not None else "")
        + f"; the largest memory is stage {summary['largest_memory_stage']}'s, "
        f"{format_bytes(summary['largest_total_bytes'])} per device ("
        + ("every stage fits its budget)" if summary["fits"] else "a stage is OVER its budget)")
    )
    return "\n\n".join(blocks)


def stage_plans_json(stages: list[Stage], plans: list[Plan]) -> str:
    entries = [
        {"stage": s.index + 1, "first_step": s.first_step, "last_step": s.last_step, "plan": plan_dict(p)}
        for s, p in zip(stages, plans)
    ]
    return json.dumps({"stages": entries, "summary": stages_summary(stages, plans)}, indent=2)
