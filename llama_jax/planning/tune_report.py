"""What `llama-jax tune` found: the Report, as the ranked table with its summary, as JSON, and the winner's config
written as YAML for `llama-jax train`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from llama_jax import config as config_lib
from llama_jax.files import atomic_path, format_bytes
from llama_jax.perf.costmodel import INTER_HOST, INTRA_HOST, CostModel
from llama_jax.perf.hardware import MfuPeaks
from llama_jax.planning.tune_space import Result


@dataclass
class Report:
    results: list[Result]
    default: Result
    winner: Result
    model: CostModel
    budget: float
    measured: bool
    correlation: float | None
    tokens: int  # per step
    model_flops: float  # per step
    devices: int
    hosts: int = 1
    device_kind: str = ""
    fp8: str = "none"  # model.fp8: MFU is also shown against the fp8 peak


def step_time(result: Result) -> float | None:
    return result.measured_s if result.measured_s is not None else result.predicted_s


def format_report(report: Report, rows: int = 20) -> str:
    """The ranked table (by measured step time where measured, then by predicted), and a summary."""
    fits = [r for r in report.results if r.predicted_s is not None and r.rejected is None]
    lines = _ranked_table(report, fits, rows)
    lines += _candidate_counts(report, fits)
    lines.append(_cost_model_line(report))
    if report.correlation is not None:
        lines.append(f"Spearman correlation of predicted and measured step times: {report.correlation:+.2f}")
    if report.default.rejected:
        lines.append(f"the default configuration cannot run: {report.default.rejected}")
    elif step_time(report.default):
        basis, winner_s, default_s = _seconds(report)
        speedup = (default_s or 0) / winner_s
        lines.append(
            f"winner {report.winner.candidate.label}: {speedup:.2f}x the default "
            f"({report.default.candidate.label}), {basis}"
        )
    return "\n".join(lines)


def _ranked_table(report: Report, fits: list[Result], rows: int) -> list[str]:
    """The best `rows` of the candidates that fit (and the default, wherever it ranks), and the table's legend."""
    ranked = sorted(fits, key=lambda r: (r.measured_s is None, step_time(r)))
    shown = ranked[:rows] + ([report.default] if report.default in ranked[rows:] else [])
    width = max(len(r.candidate.label) for r in shown) + 2
    peaks = MfuPeaks.with_fp8(report.model.peak_flops, "the cost model's", report.fp8, report.device_kind)
    lines = [
        (
            f"{'#':>3}  {'candidate':<{width}}{'memory':>10}{'predicted':>11}{'measured':>10}{'tokens/s':>11}"
            f"{'MFU':>7}" + (f"{'of fp8':>8}" if peaks.fp8 else "")
        )
    ]
    for r in shown:
        seconds = step_time(r)
        mfu = peaks.fractions(report.model_flops / seconds, report.devices)
        mark = " <- default" if r is report.default else ""
        measured = f"{r.measured_s * 1e3:8.1f}ms" if r.measured_s is not None else f"{'-':>10}"
        lines.append(
            f"{ranked.index(r) + 1:>3}  {r.candidate.label:<{width}}{r.memory_bytes / 2**20:8.0f}MiB"
            f"{r.predicted_s * 1e3:9.1f}ms{measured}{report.tokens / seconds:11,.0f}{mfu['mfu']:7.1%}"
            + (f"{mfu['mfu_fp8']:8.1%}" if peaks.fp8 else "")
            + mark
        )
    lines += [
        (
            "candidate: pP(xR)(-1f1b) pipeline stages (x repeats; the 1F1B schedule, else GPipe), d/f/t/s mesh "
            "sizes (data, fsdp, tensor, sequence; +sp: sequence parallelism), mb micro-batches (/k: k per pass "
            "through the pipeline), remat policy (/n: on every n-th layer); tokens/s and MFU from the measured step "
            "time where there is one, else the predicted"
        ),
        "",
    ]
    return lines


def _candidate_counts(report: Report, fits: list[Result]) -> list[str]:
    """How many candidates were invalid, over the budget, failed, not compiled and ranked; the invalid by reason."""
    results = report.results
    invalid = [r for r in results if r.config is None]
    over = [r for r in results if r.config is not None and (r.rejected or "").startswith("needs")]
    failed = [r for r in results if r.config is not None and r.rejected and r not in over]
    unscored = [r for r in results if r.config is not None and r.rejected is None and r.predicted_s is None]
    reasons: dict[str, int] = {}
    for r in invalid:  # counted by kind: the figures in parentheses differ from candidate to candidate
        kind = re.sub(r"\([^)]*\)", "(..)", r.rejected.split(";")[0])
        reasons[kind] = reasons.get(kind, 0) + 1
    lines = [
        f"{len(results)} candidates: {len(invalid)} invalid, {len(over)} over the memory budget of "
        f"{format_bytes(report.budget)}, {len(failed)} failed to compile or run, {len(unscored)} not compiled "
        f"(staged search or time budget), {len(fits)} ranked"
        + (f", {sum(r.measured_s is not None for r in fits)} measured" if report.measured else ""),
    ]
    lines += [f"  {n:>4} x {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    return lines


def _cost_model_line(report: Report) -> str:
    """The cost model the candidates were ranked with, its figures filled in."""
    m = report.model
    fp8_rate = (
        f" + fp8 FLOPs / ({m.fp8_peak_flops / 1e12:.4g} TFLOP/s x {m.efficiency:g})"
        if m.fp8_peak_flops and report.fp8 != "none"
        else ""
    )
    return (
        f"cost model, per device: sum over operations of max({'other ' if fp8_rate else ''}FLOPs / "
        f"({m.peak_flops / 1e12:.3g} TFLOP/s x {m.efficiency:g}){fp8_rate}, bytes / "
        f"{m.memory_bandwidth / 1e9:.3g} GB/s) + {1 - m.overlap:g} x (collective bytes within a host / "
        f"{m.bandwidth(INTRA_HOST) / 1e9:.3g} GB/s + between hosts / {m.bandwidth(INTER_HOST) / 1e9:.3g} "
        f"GB/s); {report.devices} devices on {report.hosts} host(s)"
    )


def write_winner(report: Report, out: Path) -> None:
    r = report.winner
    timing = (
        f"measured {r.measured_s * 1e3:.1f} ms"
        if r.measured_s is not None
        else f"predicted {r.predicted_s * 1e3:.1f} ms"
    )
    header = (
        f"# Written by llama-jax tune for {report.devices} {report.device_kind} device(s): {r.candidate.label},\n"
        f"# {timing} per step, {r.memory_bytes / 2**20:.0f} MiB per device. Train with: llama-jax train {out}\n"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        tmp.write_text(header + config_lib.to_yaml(r.config))


def report_json(report: Report) -> str:
    rows = [
        {
            "candidate": dataclasses.asdict(r.candidate),
            "label": r.candidate.label,
            "rejected": r.rejected,
            "memory_bytes": r.memory_bytes,
            "hlo_flops": r.hlo_flops,
            "collective_bytes": r.collective_bytes,
            "collective_tiers": r.tier_bytes,
            "predicted_s": r.predicted_s,
            "measured_s": r.measured_s,
        }
        for r in report.results
    ]
    return json.dumps(
        {
            "devices": report.devices,
            "hosts": report.hosts,
            "budget_bytes": report.budget,
            "measured": report.measured,
            "cost_model": dataclasses.asdict(report.model),
            "spearman": report.correlation,
            "default": report.default.candidate.label,
            "winner": report.winner.candidate.label,
            "candidates": rows,
        },
        indent=1,
    )


def _seconds(report: Report) -> tuple[str, float, float | None]:
    """(basis, the winner's step time, the default's or None where it cannot run): measured where both were."""
    both = report.winner.measured_s is not None and report.default.measured_s is not None
    basis = "measured" if both else "predicted"
    default = None if report.default.rejected else getattr(report.default, f"{basis}_s")
    return basis, getattr(report.winner, f"{basis}_s"), default


def format_stage_reports(tunings: list, rows: int = 20) -> str:
    """A staged run's searches (tune.tune_stages), stage by stage, then the run's time at the winners against
    the config's own settings: each stage's steps times its step time."""
    parts = [f"{t.stage.describe()}\n{format_report(t.report, rows)}" for t in tunings]
    width = max(len(t.report.winner.candidate.label) for t in tunings) + 2
    lines = [f"{'stage':<7}{'steps':>14}  {'winner':<{width}}{'memory':>10}{'step':>11}{'default':>11}{'hours':>9}"]
    hours, default_hours = 0.0, []  # a None where a stage's own settings cannot run
    for t in tunings:
        basis, seconds, default = _seconds(t.report)
        hours += t.stage.steps * seconds / 3600
        default_hours.append(t.stage.steps * default / 3600 if default else None)
        lines.append(
            f"{t.stage.index + 1:>2}/{t.stage.count:<4}{t.stage.first_step + 1:>7}-{t.stage.last_step:<6} "
            f"{t.report.winner.candidate.label:<{width}}{t.report.winner.memory_bytes / 2**20:8.0f}MiB"
            f"{seconds * 1e3:9.1f}ms"
            + (f"{default * 1e3:9.1f}ms" if default else f"{'cannot':>11}")
            + f"{t.stage.steps * seconds / 3600:9.3f}"
            + ("" if basis == "predicted" else "  (measured)")
        )
    if None in default_hours:
        lines.append(f"the whole run: {hours:.3f} hours of steps at the winners (a stage's own settings cannot run)")
    else:
        own = sum(default_hours)
        lines.append(
            f"the whole run: {hours:.3f} hours of steps at the winners, {own:.3f} at the config's own settings "
            f"({own / hours:.2f}x)"
        )
    return "\n\n".join(parts) + "\n\n" + "\n".join(lines)


def stage_reports_json(tunings: list) -> str:
    return json.dumps(
        [
            {"stage": t.stage.index + 1, "first_step": t.stage.first_step, "last_step": t.stage.last_step}
            | json.loads(report_json(t.report))
            for t in tunings
        ],
        indent=1,
    )


def write_stage_winners(tunings: list, config: config_lib.Config, out: Path) -> None:
    """The config with each stage's winning micro-batches and remat policy: the first stage's in train.* and
    remat.*, a later stage's in its own train.stages entry; the mesh as the config has it."""
    first, *later = (t.report.winner.candidate for t in tunings)
    entries = list(config.train.stages)
    for t, c in zip(tunings[1:], later):
        entries[t.stage.listed - 1] = dataclasses.replace(
            entries[t.stage.listed - 1], microbatches=c.microbatches, remat=c.policy
        )
    config = dataclasses.replace(
        config,
        train=dataclasses.replace(
            config.train, microbatches=first.microbatches, stages=type(config.train.stages)(entries)
        ),
        remat=dataclasses.replace(config.remat, policy=first.policy),
    )
    labels = "; ".join(f"stage {t.stage.index + 1}: {t.report.winner.candidate.label}" for t in tunings)
    header = (
        f"# Written by llama-jax tune, stage by stage, for {tunings[0].report.devices} "
        f"{tunings[0].report.device_kind} device(s):\n# {labels}.\n# Train with: llama-jax train {out}\n"
    )
    config_lib.validate(config)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        tmp.write_text(header + config_lib.to_yaml(config))
