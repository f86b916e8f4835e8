"""One PNG summarising a run: loss curves on top, throughput (tokens/s and MFU) below.

Reads <run_dir>/metrics.jsonl, so it works on a finished run, a run still in progress and a run
that was killed. Uses matplotlib's object API (Figure + FigureCanvasAgg) instead of pyplot, so it
touches no global backend state and is safe to call from a training process or a headless machine.
"""

from __future__ import annotations

import math
import pathlib

from llama_jax.files import atomic_path
from llama_jax.training.metrics import read_metrics


def _series(records: list[dict], field: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
    """(steps, values) of records carrying a finite number in `field`, sorted by step.

    A resumed run re-logs the steps between its last checkpoint and the crash; the later record
    for a step wins, so the curve shows what the surviving run did instead of zig-zagging.
    """
    by_step: dict[float, float] = {}
    for rec in records:
        step, value = rec.get("step"), rec.get(field)
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (step, value))
        if numeric and math.isfinite(value):  # null (NaN/inf written as null) and text skipped
            by_step[step] = value * scale
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def write_report(run_dir: pathlib.Path) -> pathlib.Path:
    """Write <run_dir>/report.png from <run_dir>/metrics.jsonl and return its path."""
    run_dir = pathlib.Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(
            f"no metrics file at {metrics_path}: is {run_dir} a run directory "
            f"(run.dir) of a run that has logged at least one step?"
        )
    records = read_metrics(metrics_path)
    if not records:
        raise FileNotFoundError(f"{metrics_path} has no complete records yet: wait for the run to log its first step")

    # Imported here: matplotlib takes ~0.4 s to import, and only the process writing a report needs it (not the
    # other processes of a job, nor one killed before its end).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 7), layout="constrained")
    FigureCanvasAgg(fig)  # attaches itself to fig; renders PNG without pyplot
    loss_ax, speed_ax = fig.subplots(2, 1, sharex=True)
    fig.suptitle(run_dir.resolve().name)

    _loss_panel(loss_ax, records)
    _throughput_panel(speed_ax, records)

    # Save next to the target and rename: a viewer never sees a half-written PNG.
    out = run_dir / "report.png"
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    return out


def _loss_panel(ax, records: list[dict]) -> None:
    """The top panel: the train and eval losses."""
    # Eval points are sparse, so markers make single evaluations visible.
    steps, loss = _series(records, "loss")
    if steps:
        ax.plot(steps, loss, lw=1.2, marker="o" if len(steps) == 1 else None, label="train loss")
    steps, eval_loss = _series(records, "eval_loss")
    if steps:
        ax.plot(steps, eval_loss, "o-", ms=4, lw=1.2, label="eval loss")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(loc="upper right")
    else:
        ax.text(0.5, 0.5, "no loss logged yet", ha="center", va="center", transform=ax.transAxes)


def _throughput_panel(ax, records: list[dict]) -> None:
    """The bottom panel: tokens/s, with MFU (stored as a fraction, shown in %) on a twin axis."""
    steps, tps = _series(records, "tokens_per_s")
    handles = []
    if steps:
        handles += ax.plot(
            steps, tps, color="tab:blue", lw=1.2, label="tokens/s", marker="o" if len(steps) == 1 else None
        )
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    steps, mfu_pct = _series(records, "mfu", scale=100.0)
    if steps:
        mfu_ax = ax.twinx()
        handles += mfu_ax.plot(
            steps, mfu_pct, color="tab:orange", lw=1.2, label="MFU (%)", marker="o" if len(steps) == 1 else None
        )
        mfu_ax.set_ylabel("MFU (%)")
        mfu_ax.set_ylim(bottom=0)  # from zero, so a small wobble does not look like a collapse
    if handles:
        ax.legend(handles=handles, loc="lower right")
    else:
        ax.text(0.5, 0.5, "no throughput logged yet", ha="center", va="center", transform=ax.transAxes)
