"""`llama-jax goodput`: the expected effective training time (goodput) of a run under failures, where the rest of
the wall time goes, and the checkpoint intervals that maximise it.

The model is goodput_model.py's (its docstring states every choice). Here: its inputs for a config on a number of
GPUs, each with its source (given by the caller, measured by a run in its goodput.json, else a stated default from
published figures). The report `llama-jax goodput` prints (text or JSON) is goodput_report.py's.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

from llama_jax.config import Config
from llama_jax.config.stages import resolve
from llama_jax.errors import InputError
from llama_jax.model.flops import train_flops_per_token
from llama_jax.model.llama import param_count
from llama_jax.perf.hardware import NIC_GBS, table_peak_flops
from llama_jax.planning.goodput_model import (
    LLAMA3_FAILURES_PER_GPU_HOUR,
    LLAMA3_MIX,
    LLAMA3_PLANNED_PER_GPU_HOUR,
    LOSES_HOST,
    Inputs,
    best_spares,
    with_auto,
)
from llama_jax.resilience.goodput import START_PARTS, read_attempts, summarize
from llama_jax.training.optimizer import state_bytes_per_param

# Stated defaults where nothing is measured (each printed with its source).
LLAMA3_MFU = 0.40  # Llama 3 405B: 38-43% bf16 MFU on 8K-16K H100s (REFERENCE.md)
DEVICE_TO_HOST_GBS = 25.0  # assumed: half of PCIe Gen5 x16's 64 GB/s, the copy a save blocks on
HOST_MEMORY_GBS = 10.0  # assumed: one host writing or reading /dev/shm
ORBAX_70B_WRITE_S, ORBAX_405B_LOAD_S = 62.0, 59.0  # Orbax's published background save / load (REFERENCE.md)
REPLACEMENT_S = 600.0  # assumed: a host from the scheduler's pool (requeue, boot); no published figure
REPAIR_H = 24.0  # assumed: a lost host drained and repaired or swapped, and a spare again; no published figure
BACKOFF_S = 10.0  # `llama-jax supervise --backoff` default
# What the cluster launchers add before the user's keys (launch/defaults.sh, its defaults; tests/test_launch.py
# checks the two agree): a projection of a launched run reads the config as its processes will.
LAUNCHER_KEYS = ("checkpoint.local_dir=/dev/shm/llama-jax", "checkpoint.local_every_steps=auto", "fault.preflight=true")

# A restart, part by part (the parts each attempt keeps in goodput.json, resilience/goodput.py), where no run
# measured them. A process's own parts do not grow with the job: measured by bench/rehearsal.py --preset llama3_8b
# --processes 2 (2026-11-28, AMD EPYC, 2 cores): the restart after a lost host. `--from RUN_DIR` measures them on
# the user's own hosts instead.
PROCESS_START_PARTS = {"launch": 0.04, "imports": 1.09, "data": 0.19, "preflight": 0.57, "loop_setup": 2.52}
# jax.distributed.initialize grows with the processes that join: bench/distributed_init.py's least-squares line
# through 2-64 processes on 127.0.0.1, the coordinator already listening (2026-11-28, AMD EPYC, 2 cores, jax
# 0.10.2: 0.005 s for 2, 0.092 s for 64), seconds = a + b x processes. Those processes share 2 cores, so the line
# overstates a cluster's per-process cost. A restart starts the coordinator and its clients together, and a client
# that finds it not yet listening retries about a second later: 1.1 s measured by the same script before it
# started the coordinator first (1.0-1.2 s wherever that happened), counted once.
DISTRIBUTED_INIT_FIT = (0.0013, 0.00144)
COORDINATOR_RETRY_S = 1.1
# The two parts of a restart no measurement here can give, named as the projection's assumptions (the third,
# SlurmdTimeout, is below):
SCHEDULER_RESTART_S = 30.0  # the scheduler relaunching the job step on every host (srun inside the allocation)
COMPILE_HIT_S = 30.0  # a large model's step loaded from the persistent compilation cache (MaxText restarts in ~40 s)
# A lost first host under slurm.sbatch (its batch script and supervisor die with it): Slurm marks the host DOWN
# SlurmdTimeout after its last word (slurm.conf's default, 300 s; a third assumption) and removes it from the job,
# the watch on another node ends the job and the successor job starts: from the failure to the successor's
# processes starting, with the host marked DOWN at once, 12.1 s in one run of bench/slurm_restart.py --first-node
# (2026-12-02, AMD EPYC, 2 cores, 3 emulated nodes; up to 10 s of it can be the watch's poll). The successor's
# process 0 then runs on another host than the lost holder of run.dir: it takes the lease over after run.lease_s
# without a beat (on the emulated nodes, one host, it did at once).
SLURMD_TIMEOUT_S = 300.0
SUCCESSOR_START_S = 12.1


# Inputs: measured by a run, else the stated defaults.

MEASURED_BUCKETS = ("data_wait", "eval", "other", "straggler")  # the steady overhead, failures or not


def restarts_of(attempts: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(failed attempt, the attempt that restarted it) pairs (a finished attempt's successor is a new run)."""
    return [
        (previous, attempt)
        for previous, attempt in zip(attempts, attempts[1:])
        if previous.get("outcome") != "finished"
    ]


def measured(run_dir: Path) -> dict[str, tuple[float, str]]:
    """Costs a run measured, from its goodput.json: name -> (value, source). Restarts: for each attempt that
    followed a failure, the gap from the failed attempt's last sign of life to the new start (detection, backoff)
    and from the start to the first step (its restart bucket less that gap, plus its compile)."""
    path = Path(run_dir) / "goodput.json"
    attempts = read_attempts(path)
    if not attempts:
        raise InputError(
            f"--from {run_dir}: no goodput.json with attempts there; name the run.dir of a run that "
            "trained (it writes <run.dir>/goodput.json)"
        )
    where = f"measured ({path})"
    found: dict[str, tuple[float, str]] = {}
    timed = sum(a.get("timed_steps", 0) for a in attempts)
    if timed:
        found["step_s"] = (sum(a.get("step_seconds", 0.0) for a in attempts) / timed, where)
    summary = summarize(attempts, max(a["last_alive"] for a in attempts))
    for kind, name in (
        ("save_durable", "save_durable_s"),
        ("save_local", "save_local_s"),
        ("write_local", "write_local_s"),
        ("restore_durable", "restore_durable_s"),
        ("restore_local", "restore_local_s"),
    ):
        entry = summary["tiers"].get(kind)
        if entry and entry["count"]:
            found[name] = (entry["seconds"] / entry["count"], where)
    gaps, restarts = [], []
    for previous, attempt in restarts_of(attempts):
        gap = max(0.0, attempt["started_at"] - previous["last_alive"])
        gaps.append(gap)
        restarts.append(max(0.0, attempt["buckets"]["restart"] - gap) + attempt["buckets"]["compile"])
    first = attempts[0]["buckets"]
    found["first_start_s"] = (first["restart"] + first["compile"], where)
    if restarts:
        found["restart_s"] = (statistics.median(restarts), where + f", median of {len(restarts)} restarts")
        found["detect_s"] = (statistics.median(gaps), where + f", median of {len(gaps)} restarts")
    if summary["productive"] > 0:
        found["steady_overhead"] = (sum(summary[b] for b in MEASURED_BUCKETS) / summary["productive"], where)
    return found


def start_parts(run_dir: Path) -> dict[str, Any]:
    """Where a run's restarts went, part by part (goodput.json's "start" of each attempt after a failure; the first
    start's where nothing failed): the median of each part, "detection" first (the failed attempt's last sign of
    life to the new process's launch: the hang or exit noticed, the processes torn down, the backoff). {} for a
    run that recorded no parts."""
    attempts = read_attempts(Path(run_dir) / "goodput.json")
    after = [(previous, a) for previous, a in restarts_of(attempts) if "start" in a]
    starts = [a["start"] for _, a in after] or [a["start"] for a in attempts[:1] if "start" in a]
    if not starts:
        return {}
    gaps = [max(0.0, a["started_at"] - p["last_alive"] - a["start"].get("launch", 0.0)) for p, a in after]
    parts = {"detection": statistics.median(gaps)} if gaps else {}
    for part in START_PARTS:
        if seen := [s[part] for s in starts if part in s]:
            parts[part] = statistics.median(seen)
    return {"of": f"median of {len(after)} restarts" if after else "the first start", "seconds": parts}


def format_start_parts(parts: dict[str, Any]) -> str:
    shown = ", ".join(f"{k} {v:.2f}" for k, v in parts["seconds"].items())
    return f"  start parts (s, {parts['of']}): {shown}"


def mix_with_host_loss_share(share: float) -> dict[str, float]:
    """Llama 3's mix with the kinds that lose a host scaled to `share` of it, the others to the rest."""
    total = sum(LLAMA3_MIX.values())
    host = sum(v for k, v in LLAMA3_MIX.items() if k in LOSES_HOST)
    return {k: v / host * share if k in LOSES_HOST else v / (total - host) * (1 - share) for k, v in LLAMA3_MIX.items()}


def _stated_costs(config: Config, gpus: int, gpus_per_host: int) -> dict[str, tuple[float, str]]:
    """Every cost of `config` on `gpus` GPUs from published figures and stated assumptions, each with its
    source: what inputs_for uses where neither the caller nor a measured run gives one."""
    values: dict[str, tuple[float, str]] = {}
    params = param_count(config.model)
    per_param = state_bytes_per_param(config)  # what a checkpoint holds: params and the optimizer's moments
    per_gpu = per_param * params / gpus
    per_host = per_gpu * min(gpus, gpus_per_host)
    c = config.checkpoint
    values["step_s"] = _stated_step_s(config, gpus)
    state = f"{per_param:.3g} B/param state ({config.train.optimizer}, {params / 1e9:.3g}B params)"
    values["save_durable_s"] = (
        per_gpu / (DEVICE_TO_HOST_GBS * 1e9),
        f"{state} per GPU at {DEVICE_TO_HOST_GBS:g} GB/s device->host (assumed)",
    )
    values["write_durable_s"] = (
        ORBAX_70B_WRITE_S * params / 70e9,
        "Orbax's 70B background save ~62 s, scaled by parameters (REFERENCE.md)",
    )
    values["restore_durable_s"] = (
        ORBAX_405B_LOAD_S * params / 405e9,
        "Orbax's 405B load ~59 s, scaled by parameters (REFERENCE.md)",
    )
    partner_copy_s = per_gpu * min(1, c.local_replicas) / (NIC_GBS * 1e9)  # one 400 Gb/s NIC per GPU
    values["save_local_s"] = (
        per_gpu / (DEVICE_TO_HOST_GBS * 1e9) + partner_copy_s,
        f"{state} per GPU at {DEVICE_TO_HOST_GBS:g} GB/s device->host (assumed) + the partner "
        f"copy at {NIC_GBS:g} GB/s per GPU (one 400 Gb/s NIC)",
    )
    values["write_local_s"] = (
        per_host * (1 + min(1, c.local_replicas)) / (HOST_MEMORY_GBS * 1e9),
        f"own and partner shards per host at {HOST_MEMORY_GBS:g} GB/s to /dev/shm (assumed)",
    )
    values["restore_local_s"] = (
        per_host / (HOST_MEMORY_GBS * 1e9) + per_gpu / (DEVICE_TO_HOST_GBS * 1e9),
        f"a host's shards at {HOST_MEMORY_GBS:g} GB/s from /dev/shm + {DEVICE_TO_HOST_GBS:g} "
        "GB/s host->device (assumed)",
    )
    values["detect_s"] = (
        config.run.heartbeat_timeout_s + BACKOFF_S,
        "run.heartbeat_timeout_s + `llama-jax supervise --backoff` (defaults)",
    )
    values["first_host_detect_s"] = (
        SLURMD_TIMEOUT_S + SUCCESSOR_START_S + config.run.lease_s,
        f"slurm.sbatch: Slurm's SlurmdTimeout ({SLURMD_TIMEOUT_S:g} s, its default; assumed) + the successor job "
        f"starting ({SUCCESSOR_START_S:g} s: bench/slurm_restart.py --first-node, 3 emulated nodes) + run.lease_s "
        "(the lost host's lease on run.dir)",
    )
    values["replacement_s"] = (
        REPLACEMENT_S,
        "assumed: a host from the scheduler's pool where no spare is free (no published figure)",
    )
    values["steady_overhead"] = (0.0, "assumed: data loading, eval and logging hidden behind the steps at scale")
    return values


def _stated_step_s(config: Config, gpus: int) -> tuple[float, str]:
    """The step time of `config` on `gpus` H100s at Llama 3's MFU, with its source."""
    t = config.train
    peak = table_peak_flops("H100", "bfloat16")  # NVIDIA's data sheet, bf16 dense (perf/hardware.py)
    # A staged run (config/stages.py): the mean step over its stages' steps, each of its own batch and length.
    stages = resolve(config)
    flops = sum(
        s.steps * train_flops_per_token(config.model, s.config.train.seq_len, causal_skip=True) * s.tokens_per_step
        for s in stages
    ) / max(1, sum(s.steps for s in stages))
    batch = (
        f"{t.batch_size} x {t.seq_len} tokens"
        if len(stages) == 1
        else f"a step, the mean over the {len(stages)} stages' steps,"
    )
    return (
        flops / (gpus * peak * LLAMA3_MFU),
        f"model FLOPs of {batch} / ({gpus} H100 x {peak / 1e12:g} TFLOP/s x {LLAMA3_MFU:.0%} MFU, Llama 3's 38-43%)",
    )


def restart_parts(config: Config, processes: int, step_s: float) -> dict[str, tuple[float, str]]:
    """A restart to its first step, part by part (seconds, source), for a job of `processes` processes (one a GPU,
    as slurm.sbatch starts them; k8s.sh starts one a host, fewer) whose step takes step_s: the scheduler's
    relaunch, each process's own start (measured here), the distributed initialisation (its line against the
    process count), the step from the compilation cache, one step. The restore is an input of its own (by tier);
    pre-flight only where fault.preflight is on."""
    here = "measured: bench/rehearsal.py's restart after a lost host, 2 CPU processes (2026-11-28)"
    parts = {
        part: (seconds, here)
        for part, seconds in PROCESS_START_PARTS.items()
        if part != "preflight" or config.fault.preflight
    }
    a, b = DISTRIBUTED_INIT_FIT
    parts["distributed_init"] = (
        COORDINATOR_RETRY_S + a + b * processes,
        f"{COORDINATOR_RETRY_S:g} s (a client's retry) + {a:.3g} s + {b:.3g} s x {processes:,} processes: "
        "bench/distributed_init.py, 2-64 processes on one machine",
    )
    parts["compile"] = (
        COMPILE_HIT_S,
        "assumed: the step loaded from the persistent compilation cache (MaxText restarts in ~40 s, REFERENCE.md)",
    )
    parts["first_step"] = (step_s, "one step (step_s)")
    relaunch = (SCHEDULER_RESTART_S, "assumed: the scheduler relaunching the job step on every host")
    return {"scheduler": relaunch, **{part: parts[part] for part in START_PARTS if part in parts}}  # a start's order


def inputs_for(
    config: Config,
    gpus: int,
    gpus_per_host: int,
    run: dict[str, tuple[float, str]] | None = None,
    failures_per_gpu_hour: float | None = None,
    planned_per_gpu_hour: float | None = None,
    host_loss_share: float | None = None,
    mix: dict[str, float] | None = None,
    spare_hosts: int | None = 0,
    repair_hours: float | None = None,
    **given: float,
) -> Inputs:
    """The inputs of `config` on `gpus` GPUs: `given` (name -> value, stated by the caller) first, then what `run`
    measured, then the stated defaults; the intervals as the config sets them, `auto` worked out as the trainer
    does (checkpoint/interval.py) with the MTBF the layout's failure rate gives (what the trainer observes).
    spare_hosts None: the count that trains the most per GPU allocated (goodput_model.best_spares)."""
    if gpus < 1 or gpus_per_host < 1 or gpus % gpus_per_host and gpus > gpus_per_host:
        raise InputError(
            f"--gpus {gpus} must be positive and a whole number of hosts of --gpus-per-host "
            f"{gpus_per_host} (e.g. --gpus 16384 --gpus-per-host 8)"
        )
    values, parts = _costs(config, gpus, gpus_per_host, run, given)
    rate, planned, rate_sources = _failure_rates(failures_per_gpu_hour, planned_per_gpu_hour)
    sources = {k: s for k, (_, s) in values.items()} | rate_sources
    sources.update({f"restart.{part}": source for part, (_, source) in parts.items()})
    mix, sources["mix"] = _failure_mix(mix, host_loss_share)
    sources.update(_spare_sources(spare_hosts, repair_hours) | _checkpoint_sources(config))
    v = {k: value for k, (value, _) in values.items()}
    x = with_auto(
        Inputs(
            gpus=gpus,
            gpus_per_host=min(gpus, gpus_per_host),
            **_checkpoint_settings(config),
            step_s=v["step_s"],
            save_durable_s=v["save_durable_s"],
            save_local_s=v["save_local_s"],
            write_durable_s=v["write_durable_s"],
            write_local_s=v["write_local_s"],
            restore_durable_s=v["restore_durable_s"],
            restore_local_s=v["restore_local_s"],
            restart_s=v["restart_s"],
            first_start_s=v["first_start_s"],
            detect_s=v["detect_s"],
            first_host_detect_s=v["first_host_detect_s"],
            hang_detect_s=v["hang_detect_s"],
            replacement_s=v["replacement_s"],
            steady_overhead=v["steady_overhead"],
            failures_per_gpu_hour=rate,
            planned_per_gpu_hour=planned,
            mix=mix,
            spare_hosts=spare_hosts or 0,
            repair_s=(REPAIR_H if repair_hours is None else repair_hours) * 3600,
            restart_parts={part: value for part, (value, _) in parts.items()},
            sources=sources,
        )
    )
    return x if spare_hosts is not None else dataclasses.replace(x, spare_hosts=best_spares(x))


def _costs(
    config: Config,
    gpus: int,
    gpus_per_host: int,
    run: dict[str, tuple[float, str]] | None,
    given: dict[str, float],
) -> tuple[dict[str, tuple[float, str]], dict[str, tuple[float, str]]]:
    """The costs (name -> (value, source)): `given` first, then what `run` measured, then the stated defaults; and
    a restart's parts (name -> (seconds, source)) where neither the caller nor the run gives restart_s, else {}."""
    values = _stated_costs(config, gpus, gpus_per_host)
    f = config.fault
    values.update(run or {})
    parts: dict[str, tuple[float, str]] = {}
    if "restart_s" not in values and "restart_s" not in given:  # the sum of its parts, from the step as it stands
        parts = restart_parts(config, gpus, values["step_s"][0])
        values["restart_s"] = (sum(value for value, _ in parts.values()), "the sum of its parts (below)")
    values["hang_detect_s"] = (
        max(f.hang_min_timeout_s, f.hang_factor * values["step_s"][0]),
        "max(fault.hang_min_timeout_s, fault.hang_factor x step_s): the watchdog",
    )
    values.update({k: (v, "given") for k, v in given.items()})
    # The first start, where no run measured it: as a restart (its cold compile has no figure at this scale).
    values.setdefault("first_start_s", (values["restart_s"][0], "as restart_s"))
    return values, parts


def _checkpoint_settings(config: Config) -> dict[str, Any]:
    """The Inputs the config's keys set: the steps, the intervals (0 where auto, which with_auto works out, or
    where there is no node-local tier), whether each is auto, the local replicas and the MTBF setting."""
    t, c = config.train, config.checkpoint
    auto = lambda setting: setting == "auto"  # noqa: E731
    return {
        "steps": t.steps,
        "durable_every": 0 if auto(c.every_steps) else int(c.every_steps),
        "local_every": 0 if auto(c.local_every_steps) or not c.local_dir else int(c.local_every_steps),
        "local_replicas": c.local_replicas,
        "durable_auto": auto(c.every_steps),
        "local_auto": bool(c.local_dir) and auto(c.local_every_steps),
        "mtbf_setting_s": c.mtbf_setting_s,
    }


def _spare_sources(spare_hosts: int | None, repair_hours: float | None) -> dict[str, str]:
    """Where the hot spares' count (None: auto) and their repair time come from."""
    return {
        "spare_hosts": "auto: the most training per GPU allocated, goodput x hosts / (hosts + spares); "
        "kept by sbatch --nodes HOSTS+S launch/slurm.sbatch --spares S, or launch/k8s.sh --spares S"
        if spare_hosts is None
        else "--spares (hot spare hosts: slurm.sbatch --spares in the allocation, k8s.sh --spares as placeholder pods)",
        "repair_s": "assumed: a lost host drained and repaired or swapped, and a spare again"
        if repair_hours is None
        else "given",
    }


def _failure_rates(failures: float | None, planned: float | None) -> tuple[float, float, dict[str, str]]:
    """(unexpected, planned interruptions per GPU-hour, their sources): given, else Llama 3's."""
    llama3 = "interruptions / (16,384 GPUs x 54 days x 24 h)"
    return (
        LLAMA3_FAILURES_PER_GPU_HOUR if failures is None else failures,
        LLAMA3_PLANNED_PER_GPU_HOUR if planned is None else planned,
        {
            "failures_per_gpu_hour": f"Llama 3: 419 unexpected {llama3}" if failures is None else "given",
            "planned_per_gpu_hour": f"Llama 3: 47 planned {llama3}" if planned is None else "given",
        },
    )


def _failure_mix(mix: dict[str, float] | None, host_loss_share: float | None) -> tuple[dict[str, float], str]:
    """The unexpected failures' mix by kind and its source: given, Llama 3's, or Llama 3's with a host loss share."""
    if mix is not None:
        return mix, "given"
    if host_loss_share is None:
        return dict(LLAMA3_MIX), "Llama 3's 419 by kind (docs/fault-tolerance.md)"
    return mix_with_host_loss_share(host_loss_share), f"Llama 3's kinds, {host_loss_share:.0%} losing a host (given)"


def _checkpoint_sources(config: Config) -> dict[str, str]:
    """Where the intervals, the local replicas and the steps come from: the config's keys (auto: Young/Daly)."""
    c, sources = config.checkpoint, {}
    for key, setting, save, write in (
        ("durable_every", c.every_steps, "save_durable_s", "write_durable_s"),
        ("local_every", c.local_every_steps if c.local_dir else 0, "save_local_s", "write_local_s"),
    ):
        sources[key] = (
            f"auto: sqrt(2 x {save} x MTBF) / step_s, at least one {write} "
            + ("(checkpoint.mtbf_hours)" if c.mtbf_setting_s else "(MTBF: this layout's)")
            if setting == "auto"
            else f"checkpoint.{'every_steps' if key == 'durable_every' else 'local_every_steps'}"
        )
    if not c.local_dir:
        sources["local_every"] = "no node-local tier (checkpoint.local_dir is empty)"
    sources["local_replicas"] = "checkpoint.local_replicas"
    sources["steps"] = "train.steps"
    return sources
