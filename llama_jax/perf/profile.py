"""Where a profiled step's time went: `llama-jax profile RUN_DIR [--json] [--top N]` over the newest trace that
run.profile_steps wrote (profiler.py).

Which file is read, and why it is parsed here: jax writes each trace twice, `<host>.xplane.pb` (the profiler's
protobuf) and `<host>.trace.json.gz`, the same events converted by jax's own exporter to Chrome's trace format
(jax 0.10 and 0.12 alike, without `create_perfetto_trace`). XProf's op-profile tools, the kept library that reads
xplane.pb, are not a dependency (≈355 MB with gRPC) and return nothing for XLA:CPU traces, and no installed package
ships xplane_pb2; so this module reads the Chrome trace with the standard library: every event that carries an
`hlo_op` argument is one execution of an instruction of a compiled module (on GPUs, a kernel of it, on the
device's stream lanes; on CPUs, a thunk on the client's threads). Only summing is done here, no decoding.

What an op is (a matmul by operand type, attention, a collective, a fusion, a copy) comes from the compiled step's
optimized HLO that the profiler saves beside the trace (step.hlo.txt), or without it from the op's name: op_class.py.

Times per step: an op's own time (an enclosing op, e.g. a while loop, is charged only for what its body ops do
not cover); the step time from the step's first op to its last (a step is one execution, the events' `run_id`);
idle is the part of it in which no op ran, the host's gaps. Ops on several lanes may overlap (XLA:CPU's thunk
threads, a GPU's collective stream), so the rows can add up to more than the step; the collectives' time that no
other op overlapped is what compute did not hide.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from llama_jax.errors import InputError
from llama_jax.files import unreadable
from llama_jax.perf.op_class import CLASSES, class_by_name, op_classes
from llama_jax.perf.profiler import HLO_FILE

# Lanes XProf derives from the kernels (they repeat their time); their events are not counted again.
DERIVED_LANES = {
    "Steps",
    "XLA Modules",
    "XLA Ops",
    "Async XLA Ops",
    "Framework Ops",
    "Framework Name Scope",
    "Source code",
    "XLA TraceMe",
    "TensorFlow Ops",
    "TensorFlow Name Scope",
}


@dataclass(frozen=True)
class OpEvent:
    """One execution of an HLO instruction (or one kernel of it) in the trace; times in microseconds."""

    op: str
    kernel: str  # the event's name: the kernel on GPUs, the op itself on CPUs
    lane: tuple  # (process, thread): ops on one lane run one after another, enclosing ones around their body
    run: str  # which execution of the module (one step)
    start: float
    duration: float

    @property
    def end(self) -> float:
        return self.start + self.duration


def module_name(hlo_text: str) -> str:
    first = hlo_text.split("\n", 1)[0].split()
    return first[1].rstrip(",") if len(first) > 1 and first[0] == "HloModule" else ""


# -- reading the trace -------------------------------------------------------------------------------------------


def find_trace(run_dir: Path) -> Path:
    """The newest trace under RUN_DIR/profile; InputError (one line) when there is none."""
    if problem := unreadable(run_dir, "directory"):
        raise InputError(f"profile: {problem}; name the run.dir of a run trained with run.profile_steps=[FIRST,LAST]")
    traces = sorted(
        (run_dir / "profile").glob("**/plugins/profile/*/*.trace.json.gz"),
        key=lambda path: (path.parent.name, path.stat().st_mtime),
    )  # the session folder: its start time
    if not traces:
        raise InputError(
            f"profile: {run_dir} holds no profile (profile/plugins/profile/*/*.trace.json.gz); capture "
            f"one with run.profile_steps=[FIRST,LAST], e.g. llama-jax train ... run.dir={run_dir} "
            "run.profile_steps=[5,7]"
        )
    return traces[-1]


def read_trace(path: Path, module: str = "") -> tuple[list[OpEvent], list[int], str]:
    """(op events of one module, the step numbers annotated, that module's name) from a Chrome trace. `module`:
    the module wanted (the train step's); absent from the trace, the module with the most op time."""
    try:
        with gzip.open(path, "rt") as stream:
            document = json.load(stream)
    except (OSError, EOFError, ValueError) as err:
        raise InputError(f"profile: cannot read {path}: {err}; capture the profile again") from None
    events = document.get("traceEvents", []) if isinstance(document, dict) else document
    names = {
        (e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name")
    }
    ops = [
        e
        for e in events
        if e.get("ph") == "X"
        and "hlo_op" in (e.get("args") or {})
        and names.get((e.get("pid"), e.get("tid")), "") not in DERIVED_LANES
    ]
    # On GPUs the host's threads also name ops (launches); the device's lanes hold the kernels' time.
    devices = {pid for (pid, tid), name in names.items() if tid is None and name.startswith("/device:")}
    if any(e["pid"] in devices for e in ops):
        ops = [e for e in ops if e["pid"] in devices]
    time_by_module: dict[str, float] = defaultdict(float)
    for e in ops:
        time_by_module[_module(e)] += float(e.get("dur", 0))
    chosen = module if module in time_by_module else max(time_by_module, key=time_by_module.get, default="")
    found = [
        OpEvent(
            e["args"]["hlo_op"],
            e.get("name", ""),
            (e.get("pid"), e.get("tid")),
            str(e["args"].get("run_id", "")),
            float(e["ts"]),
            float(e.get("dur", 0)),
        )
        for e in ops
        if _module(e) == chosen
    ]
    steps = sorted(
        int(e["args"]["step_num"])
        for e in events
        if e.get("ph") == "X" and e.get("name") == "train" and str((e.get("args") or {}).get("step_num", "")).isdigit()
    )
    return found, steps, chosen


def _module(event: dict) -> str:
    return re.sub(r"\(\d+\)$", "", str(event["args"].get("hlo_module", "")))  # GPUs add the program id: jit_f(12)


def _own_times(events: list[OpEvent]) -> tuple[list[float], list[bool]]:
    """Each event's own time (less the events it encloses on its lane) and whether it encloses any."""
    own, encloses = [e.duration for e in events], [False] * len(events)
    lanes: dict[tuple, list[int]] = defaultdict(list)
    for i, e in enumerate(events):
        lanes[e.lane].append(i)
    for indices in lanes.values():
        indices.sort(key=lambda i: (events[i].start, -events[i].duration))
        open_: list[int] = []
        for i in indices:
            while open_ and events[open_[-1]].end <= events[i].start:
                open_.pop()
            if open_:
                parent = open_[-1]
                own[parent] -= min(events[i].end, events[parent].end) - events[i].start
                encloses[parent] = True
            open_.append(i)
    return [max(0.0, t) for t in own], encloses


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _uncovered(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of the merged `spans` outside the merged `cover`."""
    total, j = 0.0, 0
    for start, end in spans:
        covered = 0.0
        while j < len(cover) and cover[j][1] <= start:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < end:
            covered += min(end, cover[k][1]) - max(start, cover[k][0])
            k += 1
        total += end - start - covered
    return total


# -- where the time went -----------------------------------------------------------------------------------------


def summarize(
    events: list[OpEvent],
    classes: dict[str, str],
    step_numbers: list[int],
    top: int = 10,
    sources: dict[str, str] | None = None,
) -> dict:
    """Per step (ms): the time by class, the collectives' time not hidden, idle time and the `top` ops."""
    own, encloses = _own_times(events)
    kind = [classes.get(e.op) or class_by_name(e.op) for e in events]
    steps, exposed_us = _steps(events, kind, encloses, step_numbers)
    # One execution per step; a trace without run ids holds one group for all the annotated steps.
    count = len(steps) if len(steps) != 1 else max(1, len(step_numbers))
    step_ms = sum(s["time_ms"] for s in steps) / count
    idle_ms = sum(s["idle_ms"] for s in steps) / count
    by_class: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_op: dict[str, dict] = {}
    for e, own_us, name in zip(events, own, kind):
        by_class[name][0] += own_us
        by_class[name][1] += 1
        row = by_op.setdefault(e.op, {"op": e.op, "class": name, "us": 0.0, "count": 0, "kernels": {}})
        row["us"] += own_us
        row["count"] += 1
        row["kernels"][e.kernel] = row["kernels"].get(e.kernel, 0.0) + own_us

    def per_step(us: float) -> float:
        return us / 1e3 / count

    return {
        "module": "",
        "steps": steps,
        "step_ms": step_ms,
        "idle_ms": idle_ms,
        "idle_share": _share(idle_ms, step_ms),
        "classes": {
            c: {
                "ms": per_step(by_class[c][0]),
                "share": _share(per_step(by_class[c][0]), step_ms),
                "ops": by_class[c][1] / count,
            }
            for c in CLASSES
            if c in by_class
        },
        "collective_ms": per_step(by_class["collective"][0]) if "collective" in by_class else 0.0,
        "collective_exposed_ms": per_step(exposed_us),
        "lanes": len({e.lane for e in events}),
        "top": [
            {
                "op": r["op"],
                "class": r["class"],
                "ms": per_step(r["us"]),
                "share": _share(per_step(r["us"]), step_ms),
                "count": r["count"] / count,
                "kernel": max(r["kernels"], key=r["kernels"].get),
                "source": (sources or {}).get(r["op"], ""),
            }
            for r in sorted(by_op.values(), key=lambda r: -r["us"])[:top]
        ],
    }


def _steps(
    events: list[OpEvent], kind: list[str], encloses: list[bool], step_numbers: list[int]
) -> tuple[list[dict], float]:
    """One row per execution of the module (its run id), in order: wall time, busy and idle time (ms), each named
    by its step number when the trace annotated as many steps; and the collectives' microseconds no other op hid."""
    runs: dict[str, list[int]] = defaultdict(list)
    for i, e in enumerate(events):
        runs[e.run].append(i)
    order = sorted(runs.values(), key=lambda indices: min(events[i].start for i in indices))
    named = len(step_numbers) == len(order)
    rows, exposed = [], 0.0
    for n, indices in enumerate(order):
        spans = [(events[i].start, events[i].end) for i in indices]
        busy = sum(b - a for a, b in _merged(spans))
        wall = max(b for _, b in spans) - min(a for a, _ in spans)
        leaves = [(span, kind[i]) for span, i in zip(spans, indices) if not encloses[i]]  # a loop hides nothing itself
        exposed += _uncovered(
            _merged([span for span, name in leaves if name == "collective"]),
            _merged([span for span, name in leaves if name != "collective"]),
        )
        rows.append(
            {
                "step": step_numbers[n] if named else None,
                "time_ms": wall / 1e3,
                "busy_ms": busy / 1e3,
                "idle_ms": (wall - busy) / 1e3,
            }
        )
    return rows, exposed


def _share(ms: float, step_ms: float) -> float:
    return ms / step_ms if step_ms else 0.0


def profile_run(run_dir: Path, top: int = 10) -> dict:
    """`summarize` of RUN_DIR's newest trace, its ops named by the step's HLO saved beside it (if any)."""
    if top < 1:
        raise InputError(f"profile: --top must be at least 1, got {top}")
    trace = find_trace(run_dir)
    hlo_path = trace.parents[3] / HLO_FILE  # <profile dir>/plugins/profile/<session>/<host>.trace.json.gz
    hlo_text = hlo_path.read_text() if hlo_path.is_file() else ""
    events, step_numbers, module = read_trace(trace, module_name(hlo_text))
    if not events:
        raise InputError(f"profile: {trace} holds no executed XLA ops; capture the profile again")
    classes, sources = op_classes(hlo_text) if hlo_text else ({}, {})
    summary = summarize(events, classes, step_numbers, top, sources)
    return {**summary, "trace": str(trace), "module": module, "classified_by": "hlo" if hlo_text else "names"}


def format_profile(profile: dict) -> str:
    """The table `llama-jax profile` prints."""
    steps = profile["steps"]
    numbers = [s["step"] for s in steps if s["step"] is not None]
    each = ", ".join(f"step {s['step']}: {s['time_ms']:.2f}" for s in steps if s["step"] is not None)
    lines = [
        f"profile {profile['trace']}",
        f"module {profile['module']}, {len(steps)} step(s)"
        f"{f' {numbers[0]}-{numbers[-1]}' if numbers else ''}: {profile['step_ms']:.2f} ms per step"
        f"{f' ({each} ms)' if len(numbers) > 1 else ''}; ops on {profile['lanes']} lane(s), classified by "
        f"{'the step HLO' if profile['classified_by'] == 'hlo' else 'their names (no step.hlo.txt)'}",
        "",
        f"{'where a step went':<22}{'ms/step':>10}{'share':>9}{'ops/step':>10}",
    ]
    rows = dict(profile["classes"])
    for always in ("attention", "collective"):
        rows.setdefault(always, {"ms": 0.0, "share": 0.0, "ops": 0})
    for name in [c for c in CLASSES if c in rows]:
        row = rows[name]
        lines.append(f"  {name:<20}{row['ms']:>10.3f}{row['share']:>9.1%}{row['ops']:>10.0f}")
    lines.append(f"  {'idle (host gaps)':<20}{profile['idle_ms']:>10.3f}{profile['idle_share']:>9.1%}")
    total = sum(r["share"] for r in rows.values()) + profile["idle_share"]
    lines.append(
        f"collectives {profile['collective_ms']:.3f} ms per step, {profile['collective_exposed_ms']:.3f} ms "
        "of it not hidden behind compute"
    )
    if total > 1.005:
        lines.append(f"(ops on several lanes ran at once: the rows add up to {total:.0%} of the step)")
    lines += ["", f"{'top ops':<30}{'ms/step':>10}{'share':>9}{'count':>7}  {'class':<15}from (or kernel)"]
    for row in profile["top"]:
        where = row["source"] or (row["kernel"] if row["kernel"] != row["op"] else "")
        lines.append(
            f"  {row['op'][:28]:<28}{row['ms']:>10.3f}{row['share']:>9.1%}{row['count']:>7.0f}  "
            f"{row['class']:<15}{where[-70:]}"
        )
    return "\n".join(lines)


def report(run_dir: Path, top: int = 10, as_json: bool = False) -> str:
    """What `llama-jax profile RUN_DIR` prints: the table, or the same as JSON."""
    profile = profile_run(run_dir, top)
    return json.dumps(profile, indent=2) if as_json else format_profile(profile)
