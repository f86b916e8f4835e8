"""What `llama-jax goodput` prints of a projection (goodput_model.py) on a run's Inputs (goodput_projection.py):
the goodput and where the rest of the wall time goes, the configured and best checkpoint intervals, durable
checkpoints only, the sensitivity to each input, and the inputs with their sources; as text or JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from llama_jax.planning.goodput_model import Inputs, best_intervals, project, sensitivity, with_auto

INPUT_FIELDS = (
    "steps",
    "step_s",
    "durable_every",
    "local_every",
    "local_replicas",
    "save_durable_s",
    "write_durable_s",
    "save_local_s",
    "write_local_s",
    "restore_durable_s",
    "restore_local_s",
    "restart_s",
    "first_start_s",
    "detect_s",
    "first_host_detect_s",
    "hang_detect_s",
    "replacement_s",
    "spare_hosts",
    "repair_s",
    "steady_overhead",
    "failures_per_gpu_hour",
    "planned_per_gpu_hour",
    "mix",
)


def report(x: Inputs) -> dict[str, Any]:
    """Everything `llama-jax goodput` prints: the projection, the best intervals, durable only, sensitivity."""
    configured = project(x)
    best = best_intervals(x)
    durable_only = dataclasses.replace(x, local_every=0, local_auto=False)
    young_daly = with_auto(dataclasses.replace(x, durable_auto=True)).durable_every
    swings = sensitivity(x)
    return {
        "goodput": configured.goodput,
        "breakdown": configured.breakdown,
        "intervals": {
            "configured": {"durable_every": x.durable_every, "local_every": x.local_every},
            "best": {"durable_every": best.durable_every, "local_every": best.local_every, "goodput": best.goodput},
            "young_daly_durable_every": young_daly,
        },
        "durable_only": {
            "goodput": project(durable_only).goodput,
            "best": {
                "durable_every": (b := best_intervals(durable_only, local=False)).durable_every,
                "goodput": b.goodput,
            },
        },
        "per_failure_s": configured.per_failure_s,
        "failures": {"mtbf_h": x.mtbf_s / 3600, "shares": x.shares(), "hosts": x.hosts},
        "sensitivity": {k: {"at_50pct": lo, "at_150pct": hi} for k, (lo, hi) in swings.items()},
        "most_sensitive": max(swings, key=lambda k: abs(swings[k][1] - swings[k][0])),
        "inputs": {k: {"value": getattr(x, k), "source": x.sources.get(k, "")} for k in INPUT_FIELDS},
        "restart_parts": {
            part: {"value": value, "source": x.sources.get(f"restart.{part}", "")}
            for part, value in x.restart_parts.items()
        },
        "no_spare_chance": x.no_spare_chance,
        # the spares' hosts wait instead of training: the share of the allocation's GPU time that trains
        "per_gpu_allocated": configured.goodput * x.hosts / (x.hosts + x.spare_hosts),
        "wall_s": configured.wall_s,
    }


def format_report(r: dict[str, Any], name: str, x: Inputs) -> str:
    pct = lambda v: f"{100 * v:.1f}%"  # noqa: E731
    lines = [
        f"goodput projection: {name} on {x.gpus:,} GPUs ({x.hosts:,} hosts of {x.gpus_per_host}), {x.steps:,} steps",
        f"  failures: one every {r['failures']['mtbf_h']:.3g} h; by kind: "
        + ", ".join(f"{k} {pct(v)}" for k, v in r["failures"]["shares"].items() if v),
    ]
    lines.append("  inputs:")
    for k, entry in r["inputs"].items():
        value = entry["value"]
        shown = (
            ", ".join(f"{m} {w:g}" for m, w in value.items())
            if isinstance(value, dict)
            else f"{value:.3g}"
            if isinstance(value, float)
            else f"{value}"
        )
        lines.append(f"    {k:<22} {shown:<14} {entry['source']}")
        if k == "restart_s":
            for part, each in r["restart_parts"].items():
                lines.append(f"      {part:<20} {each['value']:<14.3g} {each['source']}")
        if k == "repair_s" and x.spare_hosts:
            lines.append(f"      {'no spare free':<20} {r['no_spare_chance']:<14.3g} a lost host's chance")
    lines.append(f"  goodput {pct(r['goodput'])}: " + ", ".join(f"{k} {pct(v)}" for k, v in r["breakdown"].items()))
    if x.spare_hosts:
        spares = f"{x.spare_hosts} spare host(s) idle beside the {x.hosts:,}"
        lines.append(f"  per GPU allocated, {spares}: {pct(r['per_gpu_allocated'])}")
    lines.append(
        "  per failure (s): "
        + "; ".join(f"{k} " + "/".join(f"{v:.0f}" for v in c.values()) for k, c in r["per_failure_s"].items())
        + " ("
        + "/".join(next(iter(r["per_failure_s"].values())))
        + ")"
    )
    i = r["intervals"]
    lines.append(
        f"  intervals: configured durable every {i['configured']['durable_every']}, local every "
        f"{i['configured']['local_every']}; best: durable every {i['best']['durable_every']}, local every "
        f"{i['best']['local_every']} -> {pct(i['best']['goodput'])}; Young/Daly durable every "
        f"{i['young_daly_durable_every']}"
    )
    d = r["durable_only"]
    lines.append(
        f"  durable checkpoints only: {pct(d['goodput'])} (best: every {d['best']['durable_every']} -> "
        f"{pct(d['best']['goodput'])})"
    )
    swings = ", ".join(f"{k} {100 * (s['at_150pct'] - s['at_50pct']):+.2f} pt" for k, s in r["sensitivity"].items())
    lines.append(
        f"  sensitivity (goodput at 150% minus at 50% of each input): {swings}; most sensitive: {r['most_sensitive']}"
    )
    return "\n".join(lines)


def report_json(r: dict[str, Any]) -> str:
    """JSON (strict: an infinite figure, e.g. the MTBF without failures, is null)."""

    def finite(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: finite(w) for k, w in v.items()}
        return None if isinstance(v, float) and not math.isfinite(v) else v

    return json.dumps(finite(r), indent=2)
