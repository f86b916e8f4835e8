"""`llama-jax goodput`: the expected effective training time (goodput) of a run under failures, where the rest of
the wall time goes, and the checkpoint intervals that maximise it.

The model (every choice here is a first-order one, stated where it is made):
- Failures arrive as a Poisson process over wall time, at `failures_per_gpu_hour` x GPUs (unexpected ones, split
  into kinds by `mix`) plus `planned_per_gpu_hour` x GPUs preemptions. Failures during recovery count too: they
  are part of the wall time the rate applies to.
- Each failure of kind k costs F_k seconds: detection (a crash: the heartbeat timeout plus the supervisor's
  backoff; a hang: the watchdog's timeout), a replacement host when it loses one, restart to the first step
  (process start and compile), the restore of the tier that serves it, and the progress lost since that tier's
  newest checkpoint.
- A tier saving every n steps holds, at a failure at a uniformly random time, a newest checkpoint n/2 steps old
  on average, plus its commit latency (a save counts once its write is done: an asynchronous durable write, the
  local tier's background write). With two tiers the newest of either serves (mean age of the union of both
  step sequences, computed exactly over their common period).
- A failure that loses a host restores from the local tier only if a partner's copy of that host's shards
  survives (checkpoint.local_replicas >= 1 and more than one host), i.e. unless the partner host is lost too
  before the restore: probability 1 - exp(-host-loss rate per host x that window); else from the durable tier.
- Saves block the loop for save_s each, per tier, plus the wait for the previous save's write when the interval
  is shorter than a write: overhead (save_s + max(0, write_s - n x step_s)) / (n x step_s) per productive second.
- A finite run of P = steps x step_s productive seconds, a first start and a final save:
      wall = (first start + final save + P x (1 + save overhead + steady overhead)) / (1 - rate x mean F)
  goodput = P / wall, and every part of the breakdown is its share of that wall time (they sum to 1).
  rate x mean F >= 1 means the run never finishes: goodput 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llama_jax.checkpoint.interval import auto_checkpoint_steps
from llama_jax.config import Config
from llama_jax.errors import InputError
from llama_jax.model.llama import param_count, train_flops_per_token
from llama_jax.perf.hardware import NIC_GBS, table_peak_flops
from llama_jax.resilience.goodput import read_attempts, summarize

# Llama 3 405B's pre-training (REFERENCE.md, "Failures at scale"): 419 unexpected interruptions in 54 days on
# 16,384 H100s, and 47 planned ones.
LLAMA3_GPU_HOURS = 16_384 * 54 * 24
LLAMA3_FAILURES_PER_GPU_HOUR = 419 / LLAMA3_GPU_HOURS  # 1.97e-5
LLAMA3_PLANNED_PER_GPU_HOUR = 47 / LLAMA3_GPU_HOURS
# The 419 by what they do to a run here. A hardware fault takes its host out of the job (the GPU, its memory or
# its host must be drained and replaced; the host's /dev/shm goes with it): faulty GPU 148, HBM3 72, SRAM 19,
# GPU system processor 17, network switch/cable 35, host maintenance 32, NIC 7 and the small rest (16). Software
# bugs (54) crash processes on hosts that stay; NCCL watchdog timeouts (7) are hangs; silent data corruption (6)
# leaves the newest checkpoint untrusted (one more interval lost); GPU thermal faults (6) are slow devices, which
# pre-flight names at the next start (that start fails, the host is replaced).
LLAMA3_MIX = {"host_lost": 346, "crash": 54, "hang": 7, "damaged_checkpoint": 6, "slow_device": 6}
KINDS = ("host_lost", "crash", "hang", "damaged_checkpoint", "slow_device", "preemption")
LOSES_HOST = {"host_lost", "slow_device"}
LLAMA3_HOST_LOSS_SHARE = sum(v for k, v in LLAMA3_MIX.items() if k in LOSES_HOST) / 419  # 352/419 = 0.84

# Stated defaults where nothing is measured (each printed with its source).
LLAMA3_MFU = 0.40  # Llama 3 405B: 38-43% bf16 MFU on 8K-16K H100s (REFERENCE.md)
STATE_BYTES_PER_PARAM = 12  # float32 params + AdamW's two float32 moments: what a checkpoint holds
DEVICE_TO_HOST_GBS = 25.0  # assumed: half of PCIe Gen5 x16's 64 GB/s, the copy a save blocks on
HOST_MEMORY_GBS = 10.0  # assumed: one host writing or reading /dev/shm
ORBAX_70B_WRITE_S, ORBAX_405B_LOAD_S = 62.0, 59.0  # Orbax's published background save / load (REFERENCE.md)
FULL_RESTART_S = 600.0  # torchft: ~10 min stall per failure with a full restart at ~100K GPUs (REFERENCE.md)
REPLACEMENT_S = 600.0  # assumed: a spare host from the scheduler's pool (requeue, boot); no published figure
BACKOFF_S = 10.0  # `llama-jax supervise --backoff` default


@dataclass(frozen=True)
class Inputs:
    """Everything a projection is worked out from; `sources` says where each figure came from."""

    gpus: int
    gpus_per_host: int
    steps: int
    step_s: float
    durable_every: int  # steps between durable saves (0: none during the run)
    local_every: int  # steps between node-local saves (0: no local tier)
    local_replicas: int
    save_durable_s: float  # seconds a save blocks the loop, per tier
    save_local_s: float
    write_durable_s: float  # a save's commit latency after it unblocks (its background write)
    write_local_s: float
    restore_durable_s: float
    restore_local_s: float
    restart_s: float  # process start + compile, to the first step
    first_start_s: float  # the run's first start (cold compile, pre-flight)
    detect_s: float  # a crash: until the new processes start (heartbeat timeout, supervisor backoff)
    hang_detect_s: float  # a hang: the watchdog's timeout
    replacement_s: float  # waiting for a host to replace a lost one
    steady_overhead: float  # data wait, eval, logging: seconds per productive second, failures or not
    failures_per_gpu_hour: float
    planned_per_gpu_hour: float
    mix: dict[str, float] = field(default_factory=lambda: dict(LLAMA3_MIX))  # unexpected failures by kind
    durable_auto: bool = False  # the interval is checkpoint/interval.py's automatic one, worked out by with_auto
    local_auto: bool = False
    mtbf_setting_s: float = 0.0  # checkpoint.mtbf_hours (0: the MTBF the failure rate gives, as the trainer observes)
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def hosts(self) -> int:
        return max(1, self.gpus // self.gpus_per_host)

    @property
    def failure_rate_s(self) -> float:
        """Interruptions (unexpected and planned) per second of wall time, for the whole job."""
        return (self.failures_per_gpu_hour + self.planned_per_gpu_hour) * self.gpus / 3600

    @property
    def mtbf_s(self) -> float:
        rate = self.failure_rate_s
        return 1 / rate if rate > 0 else math.inf

    def shares(self) -> dict[str, float]:
        """Each kind's share of all interruptions (planned preemptions included)."""
        total = self.failures_per_gpu_hour + self.planned_per_gpu_hour
        if total <= 0:
            return dict.fromkeys(KINDS, 0.0)
        mixed = sum(self.mix.values()) or 1.0
        unexpected = {k: self.failures_per_gpu_hour / total * self.mix.get(k, 0.0) / mixed for k in KINDS}
        return {**unexpected, "preemption": self.planned_per_gpu_hour / total}

    def scaled(self, name: str, factor: float) -> Inputs:
        return dataclasses.replace(self, **{name: getattr(self, name) * factor})


def with_auto(x: Inputs) -> Inputs:
    """`x` with its automatic intervals worked out as the trainer does (checkpoint/interval.py) from its own step
    time, save costs and MTBF; a changed input (sensitivity) changes them as it would change the trainer's."""
    mtbf_s = x.mtbf_setting_s or x.mtbf_s
    if not math.isfinite(mtbf_s):
        return dataclasses.replace(x, durable_every=0 if x.durable_auto else x.durable_every,
                                   local_every=0 if x.local_auto else x.local_every)  # no failures: save at the end
    durable = (auto_checkpoint_steps(x.save_durable_s, mtbf_s, x.step_s, x.write_durable_s) if x.durable_auto
               else x.durable_every)
    local = auto_checkpoint_steps(x.save_local_s, mtbf_s, x.step_s, x.write_local_s) if x.local_auto else x.local_every
    return dataclasses.replace(x, durable_every=durable, local_every=local)


def mean_age_steps(a: int, b: int) -> float:
    """Mean age (steps) at a uniformly random time of the newest step that is a multiple of a or of b (0: that
    tier does not save). Exact over one common period when it is short, else the independent-phases
    approximation E[min(U_a, U_b)] = s/2 - s^2/(6 l) for the shorter s and longer l."""
    intervals = sorted(x for x in (a, b) if x > 0)
    if not intervals:
        return math.inf
    if len(intervals) == 1 or intervals[1] % intervals[0] == 0:
        return intervals[0] / 2
    short, long_ = intervals
    period = short * long_ // math.gcd(short, long_)
    if period > 1_000_000:
        return short / 2 - short ** 2 / (6 * long_)
    saved = sorted(set(range(0, period + 1, short)) | set(range(0, period + 1, long_)))
    return sum((y - x) ** 2 for x, y in zip(saved, saved[1:])) / (2 * period)


@dataclass(frozen=True)
class Projection:
    goodput: float
    wall_s: float
    breakdown: dict[str, float]  # shares of the wall time, summing to 1
    per_failure_s: dict[str, dict[str, float]]  # kind -> component -> seconds
    durable_every: int
    local_every: int


def project(x: Inputs, durable_every: int | None = None, local_every: int | None = None) -> Projection:
    """The expected goodput of `x` (with these intervals in place of its own, if given)."""
    nd = x.durable_every if durable_every is None else durable_every
    nl = x.local_every if local_every is None else local_every
    productive = x.steps * x.step_s
    # Age of the newest checkpoint a restore can use, in seconds (a tier without periodic saves: the run's
    # progress so far, half of it on average). The commit latency is the saving tier's; with both, the more
    # frequent one's.
    no_checkpoint_age = productive / 2

    def age(steps: float, latency: float) -> float:
        return min(steps * x.step_s + latency, no_checkpoint_age) if math.isfinite(steps) else no_checkpoint_age

    durable_age = age(mean_age_steps(nd, 0), x.write_durable_s)
    local_latency = x.write_local_s if nl and (not nd or nl <= nd) else x.write_durable_s
    union_age = age(mean_age_steps(nd, nl), local_latency) if nl else durable_age
    partner = nl > 0 and x.local_replicas >= 1 and x.hosts > 1
    host_loss_per_host_s = (x.failures_per_gpu_hour * x.gpus_per_host / 3600
                            * sum(x.mix.get(k, 0) for k in LOSES_HOST) / (sum(x.mix.values()) or 1))

    def restore(host_lost: bool, window: float) -> tuple[float, float, float]:
        """(restore seconds, lost seconds, the served tier's interval in seconds) for a restart."""
        if nl and not host_lost:
            return x.restore_local_s, union_age, (min(nl, nd) if nd else nl) * x.step_s
        if host_lost and partner:
            survives = math.exp(-host_loss_per_host_s * window)
            return (survives * x.restore_local_s + (1 - survives) * x.restore_durable_s,
                    survives * union_age + (1 - survives) * durable_age,
                    (min(nl, nd) if nd else nl) * x.step_s)
        return x.restore_durable_s, durable_age, (nd * x.step_s if nd else no_checkpoint_age)

    per_failure: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        host_lost = kind in LOSES_HOST
        detect = {"hang": x.hang_detect_s, "preemption": 0.0}.get(kind, x.detect_s)
        replacement = x.replacement_s if host_lost else 0.0
        restart = x.restart_s * (2 if kind == "slow_device" else 1)  # a first start that pre-flight refuses
        restore_s, lost, interval = restore(host_lost, detect + replacement + restart)
        if kind == "damaged_checkpoint":  # the newest is set aside after a failed read: one interval further back
            restore_s, lost = 2 * restore_s, min(lost + interval, no_checkpoint_age)
        save = 0.0
        if kind == "preemption":  # SIGTERM: the step is saved (and written) before the exit, nothing is lost
            restore_s, lost, save = x.restore_durable_s, 0.0, x.save_durable_s + x.write_durable_s
        per_failure[kind] = {"detect": detect, "replacement": replacement, "restart": restart, "restore": restore_s,
                             "lost": lost, "checkpoint_save": save}

    shares = x.shares()
    rate = x.failure_rate_s
    components = ("detect", "replacement", "restart", "restore", "lost", "checkpoint_save")
    mean = {c: sum(shares[k] * per_failure[k][c] for k in KINDS) for c in components}
    # A save blocks for its copy, and also waits for the previous save's write when that is still running
    # (checkpoint/interval.py: the interval is never shorter than one write).
    def overhead(every: int, save_s: float, write_s: float) -> float:
        return (save_s + max(0.0, write_s - every * x.step_s)) / (every * x.step_s) if every else 0.0

    save_overhead = overhead(nd, x.save_durable_s, x.write_durable_s) + overhead(nl, x.save_local_s, x.write_local_s)
    fixed = x.first_start_s + x.save_durable_s + x.write_durable_s  # first start; the final save, waited for
    busy = rate * sum(mean.values())
    if busy >= 1:
        return Projection(0.0, math.inf, {"productive": 0.0}, per_failure, nd, nl)
    wall = (fixed + productive * (1 + save_overhead + x.steady_overhead)) / (1 - busy)
    breakdown = {
        "productive": productive / wall,
        "checkpoint_save": (productive * save_overhead + x.save_durable_s + x.write_durable_s) / wall
        + rate * mean["checkpoint_save"],
        "lost": rate * mean["lost"],
        "restart": (x.first_start_s / wall) + rate * (mean["restart"] + mean["detect"]),
        "checkpoint_restore": rate * mean["restore"],
        "replacement_wait": rate * mean["replacement"],
        "steady_overhead": productive * x.steady_overhead / wall,
    }
    return Projection(productive / wall, wall, breakdown, per_failure, nd, nl)


def _grid(top: int) -> list[int]:
    """Step intervals from 1 to `top`, about 12 per factor of 10."""
    values, v = set(), 1.0
    while v <= max(1, top):
        values.add(int(round(v)))
        v *= 10 ** (1 / 12)
    return sorted(values | {max(1, top)})


def best_intervals(x: Inputs, local: bool | None = None) -> Projection:
    """The intervals that maximise goodput: durable alone, or (local tier) local every n and durable every k x n
    (durable saves on local save steps, so the newest of either is always the local one)."""
    local = x.local_every > 0 if local is None else local
    candidates = [(x.durable_every, x.local_every if local else 0)]
    for n in _grid(x.steps) if local else [0]:
        for durable in _grid(x.steps // max(1, n)) if local else _grid(x.steps):
            candidates.append((durable * max(1, n) if local else durable, n))
    return max((project(x, d, n) for d, n in candidates), key=lambda p: p.goodput)


SENSITIVE = ("failures_per_gpu_hour", "step_s", "save_durable_s", "save_local_s", "write_durable_s", "restart_s",
             "restore_durable_s", "restore_local_s", "detect_s", "replacement_s")


def sensitivity(x: Inputs, names: tuple[str, ...] = SENSITIVE) -> dict[str, tuple[float, float]]:
    """name -> (goodput with that input at 50%, at 150%), everything else as it is; automatic intervals follow the
    changed input, as the trainer's would."""
    return {n: (project(with_auto(x.scaled(n, 0.5))).goodput, project(with_auto(x.scaled(n, 1.5))).goodput)
            for n in names}


# Inputs: measured by a run, else the stated defaults.

MEASURED_BUCKETS = ("data_wait", "eval", "other", "straggler")  # the steady overhead, failures or not


def measured(run_dir: Path) -> dict[str, tuple[float, str]]:
    """Costs a run measured, from its goodput.json: name -> (value, source). Restarts: for each attempt that
    followed a failure, the gap from the failed attempt's last sign of life to the new start (detection, backoff)
    and from the start to the first step (its restart bucket less that gap, plus its compile)."""
    path = Path(run_dir) / "goodput.json"
    attempts = read_attempts(path)
    if not attempts:
        raise InputError(f"--from {run_dir}: no goodput.json with attempts there; name the run.dir of a run that "
                         "trained (it writes <run.dir>/goodput.json)")
    where = f"measured ({path})"
    found: dict[str, tuple[float, str]] = {}
    timed = sum(a.get("timed_steps", 0) for a in attempts)
    if timed:
        found["step_s"] = (sum(a.get("step_seconds", 0.0) for a in attempts) / timed, where)
    summary = summarize(attempts, max(a["last_alive"] for a in attempts))
    for kind, name in (("save_durable", "save_durable_s"), ("save_local", "save_local_s"),
                       ("write_local", "write_local_s"), ("restore_durable", "restore_durable_s"),
                       ("restore_local", "restore_local_s")):
        entry = summary["tiers"].get(kind)
        if entry and entry["count"]:
            found[name] = (entry["seconds"] / entry["count"], where)
    gaps, restarts = [], []
    for previous, attempt in zip(attempts, attempts[1:]):
        if previous.get("outcome") == "finished":
            continue
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
    per_gpu = STATE_BYTES_PER_PARAM * params / gpus
    per_host = per_gpu * min(gpus, gpus_per_host)
    t, c = config.train, config.checkpoint
    tokens = t.batch_size * t.seq_len
    peak = table_peak_flops("H100", "bfloat16")  # NVIDIA's data sheet, bf16 dense (perf/hardware.py)
    flops = train_flops_per_token(config.model, t.seq_len, causal_skip=True) * tokens
    values["step_s"] = (flops / (gpus * peak * LLAMA3_MFU),
                        f"model FLOPs of {t.batch_size} x {t.seq_len} tokens / ({gpus} H100 x {peak / 1e12:g} "
                        f"TFLOP/s x {LLAMA3_MFU:.0%} MFU, Llama 3's 38-43%)")
    state = f"{STATE_BYTES_PER_PARAM} B/param state ({params / 1e9:.3g}B params)"
    values["save_durable_s"] = (per_gpu / (DEVICE_TO_HOST_GBS * 1e9),
                                f"{state} per GPU at {DEVICE_TO_HOST_GBS:g} GB/s device->host (assumed)")
    values["write_durable_s"] = (ORBAX_70B_WRITE_S * params / 70e9, "Orbax's 70B background save ~62 s, scaled by "
                                 "parameters (REFERENCE.md)")
    values["restore_durable_s"] = (ORBAX_405B_LOAD_S * params / 405e9, "Orbax's 405B load ~59 s, scaled by "
                                   "parameters (REFERENCE.md)")
    partner_copy_s = per_gpu * min(1, c.local_replicas) / (NIC_GBS * 1e9)  # one 400 Gb/s NIC per GPU
    values["save_local_s"] = (per_gpu / (DEVICE_TO_HOST_GBS * 1e9) + partner_copy_s,
                              f"{state} per GPU at {DEVICE_TO_HOST_GBS:g} GB/s device->host (assumed) + the partner "
                              f"copy at {NIC_GBS:g} GB/s per GPU (one 400 Gb/s NIC)")
    values["write_local_s"] = (per_host * (1 + min(1, c.local_replicas)) / (HOST_MEMORY_GBS * 1e9),
                               f"own and partner shards per host at {HOST_MEMORY_GBS:g} GB/s to /dev/shm (assumed)")
    values["restore_local_s"] = (per_host / (HOST_MEMORY_GBS * 1e9) + per_gpu / (DEVICE_TO_HOST_GBS * 1e9),
                                 f"a host's shards at {HOST_MEMORY_GBS:g} GB/s from /dev/shm + {DEVICE_TO_HOST_GBS:g} "
                                 "GB/s host->device (assumed)")
    values["restart_s"] = (FULL_RESTART_S, "torchft's ~10 min stall per failure with a full restart at ~100K GPUs "
                           "(REFERENCE.md)")
    values["first_start_s"] = (FULL_RESTART_S, "as restart_s")
    values["detect_s"] = (config.run.heartbeat_timeout_s + BACKOFF_S,
                          "run.heartbeat_timeout_s + `llama-jax supervise --backoff` (defaults)")
    values["replacement_s"] = (REPLACEMENT_S, "assumed: a spare host from the scheduler's pool (no published figure)")
    values["steady_overhead"] = (0.0, "assumed: data loading, eval and logging hidden behind the steps at scale")
    return values


def inputs_for(config: Config, gpus: int, gpus_per_host: int, run: dict[str, tuple[float, str]] | None = None,
               failures_per_gpu_hour: float | None = None, planned_per_gpu_hour: float | None = None,
               host_loss_share: float | None = None, mix: dict[str, float] | None = None,
               **given: float) -> Inputs:
    """The inputs of `config` on `gpus` GPUs: `given` (name -> value, stated by the caller) first, then what `run`
    measured, then the stated defaults; the intervals as the config sets them, `auto` worked out as the trainer
    does (checkpoint/interval.py) with the MTBF the layout's failure rate gives (what the trainer observes)."""
    if gpus < 1 or gpus_per_host < 1 or gpus % gpus_per_host and gpus > gpus_per_host:
        raise InputError(f"--gpus {gpus} must be positive and a whole number of hosts of --gpus-per-host "
                         f"{gpus_per_host} (e.g. --gpus 16384 --gpus-per-host 8)")
    values = _stated_costs(config, gpus, gpus_per_host)
    t, c, f = config.train, config.checkpoint, config.fault
    values.update(run or {})
    values["hang_detect_s"] = (max(f.hang_min_timeout_s, f.hang_factor * values["step_s"][0]),
                               "max(fault.hang_min_timeout_s, fault.hang_factor x step_s): the watchdog")
    values.update({k: (v, "given") for k, v in given.items()})
    rate = LLAMA3_FAILURES_PER_GPU_HOUR if failures_per_gpu_hour is None else failures_per_gpu_hour
    planned = LLAMA3_PLANNED_PER_GPU_HOUR if planned_per_gpu_hour is None else planned_per_gpu_hour
    sources = {k: s for k, (_, s) in values.items()}
    sources["failures_per_gpu_hour"] = ("Llama 3: 419 unexpected interruptions / (16,384 GPUs x 54 days x 24 h)"
                                        if failures_per_gpu_hour is None else "given")
    sources["planned_per_gpu_hour"] = ("Llama 3: 47 planned interruptions / (16,384 GPUs x 54 days x 24 h)"
                                       if planned_per_gpu_hour is None else "given")
    if mix is None:
        mix = dict(LLAMA3_MIX) if host_loss_share is None else mix_with_host_loss_share(host_loss_share)
        sources["mix"] = ("Llama 3's 419 by kind (docs/fault-tolerance.md)" if host_loss_share is None
                          else f"Llama 3's kinds, {host_loss_share:.0%} losing a host (given)")
    else:
        sources["mix"] = "given"
    v = {k: value for k, (value, _) in values.items()}
    for key, setting, save, write in (("durable_every", c.every_steps, "save_durable_s", "write_durable_s"),
                                      ("local_every", c.local_every_steps if c.local_dir else 0, "save_local_s",
                                       "write_local_s")):
        sources[key] = (f"auto: sqrt(2 x {save} x MTBF) / step_s, at least one {write} "
                        + ("(checkpoint.mtbf_hours)" if c.mtbf_setting_s else "(MTBF: this layout's)")
                        if setting == "auto"
                        else f"checkpoint.{'every_steps' if key == 'durable_every' else 'local_every_steps'}")
    if not c.local_dir:
        sources["local_every"] = "no node-local tier (checkpoint.local_dir is empty)"
    sources["local_replicas"] = "checkpoint.local_replicas"
    sources["steps"] = "train.steps"
    auto = lambda setting: setting == "auto"  # noqa: E731
    return with_auto(Inputs(
        gpus=gpus, gpus_per_host=min(gpus, gpus_per_host), steps=t.steps, step_s=v["step_s"],
        durable_every=0 if auto(c.every_steps) else int(c.every_steps),
        local_every=0 if auto(c.local_every_steps) or not c.local_dir else int(c.local_every_steps),
        local_replicas=c.local_replicas,
        save_durable_s=v["save_durable_s"], save_local_s=v["save_local_s"],
        write_durable_s=v["write_durable_s"], write_local_s=v["write_local_s"],
        restore_durable_s=v["restore_durable_s"], restore_local_s=v["restore_local_s"],
        restart_s=v["restart_s"], first_start_s=v["first_start_s"], detect_s=v["detect_s"],
        hang_detect_s=v["hang_detect_s"], replacement_s=v["replacement_s"],
        steady_overhead=v["steady_overhead"], failures_per_gpu_hour=rate, planned_per_gpu_hour=planned,
        mix=mix, durable_auto=auto(c.every_steps), local_auto=bool(c.local_dir) and auto(c.local_every_steps),
        mtbf_setting_s=c.mtbf_setting_s, sources=sources))


# Output

INPUT_FIELDS = ("steps", "step_s", "durable_every", "local_every", "local_replicas", "save_durable_s",
                "write_durable_s", "save_local_s", "write_local_s", "restore_durable_s", "restore_local_s",
                "restart_s", "first_start_s", "detect_s", "hang_detect_s", "replacement_s", "steady_overhead",
                "failures_per_gpu_hour", "planned_per_gpu_hour", "mix")


def report(x: Inputs) -> dict[str, Any]:
    """Everything `llama-jax goodput` prints: the projection, the best intervals, durable only, sensitivity."""
    configured = project(x)
    best = best_intervals(x)
    durable_only = dataclasses.replace(x, local_every=0, local_auto=False)
    young_daly = with_auto(dataclasses.replace(x, durable_auto=True)).durable_every
    swings = sensitivity(x)
    return {
        "goodput": configured.goodput, "breakdown": configured.breakdown,
        "intervals": {
            "configured": {"durable_every": x.durable_every, "local_every": x.local_every},
            "best": {"durable_every": best.durable_every, "local_every": best.local_every, "goodput": best.goodput},
            "young_daly_durable_every": young_daly},
        "durable_only": {"goodput": project(durable_only).goodput,
                         "best": {"durable_every": (b := best_intervals(durable_only, local=False)).durable_every,
                                  "goodput": b.goodput}},
        "per_failure_s": configured.per_failure_s,
        "failures": {"mtbf_h": x.mtbf_s / 3600, "shares": x.shares(), "hosts": x.hosts},
        "sensitivity": {k: {"at_50pct": lo, "at_150pct": hi} for k, (lo, hi) in swings.items()},
        "most_sensitive": max(swings, key=lambda k: abs(swings[k][1] - swings[k][0])),
        "inputs": {k: {"value": getattr(x, k), "source": x.sources.get(k, "")} for k in INPUT_FIELDS},
        "wall_s": configured.wall_s}


def format_report(r: dict[str, Any], name: str, x: Inputs) -> str:
    pct = lambda v: f"{100 * v:.1f}%"  # noqa: E731
    lines = [f"goodput projection: {name} on {x.gpus:,} GPUs ({x.hosts:,} hosts of {x.gpus_per_host}), "
             f"{x.steps:,} steps",
             f"  failures: one every {r['failures']['mtbf_h']:.3g} h; by kind: "
             + ", ".join(f"{k} {pct(v)}" for k, v in r["failures"]["shares"].items() if v)]
    lines.append("  inputs:")
    for k, entry in r["inputs"].items():
        value = entry["value"]
        shown = (", ".join(f"{m} {w:g}" for m, w in value.items()) if isinstance(value, dict)
                 else f"{value:.3g}" if isinstance(value, float) else f"{value}")
        lines.append(f"    {k:<22} {shown:<14} {entry['source']}")
    lines.append(f"  goodput {pct(r['goodput'])}: " + ", ".join(f"{k} {pct(v)}" for k, v in r["breakdown"].items()))
    lines.append("  per failure (s): " + "; ".join(
        f"{k} " + "/".join(f"{v:.0f}" for v in c.values()) for k, c in r["per_failure_s"].items())
        + " (" + "/".join(next(iter(r["per_failure_s"].values()))) + ")")
    i = r["intervals"]
    lines.append(f"  intervals: configured durable every {i['configured']['durable_every']}, local every "
                 f"{i['configured']['local_every']}; best: durable every {i['best']['durable_every']}, local every "
                 f"{i['best']['local_every']} -> {pct(i['best']['goodput'])}; Young/Daly durable every "
                 f"{i['young_daly_durable_every']}")
    d = r["durable_only"]
    lines.append(f"  durable checkpoints only: {pct(d['goodput'])} (best: every {d['best']['durable_every']} -> "
                 f"{pct(d['best']['goodput'])})")
    swings = ", ".join(f"{k} {100 * (s['at_150pct'] - s['at_50pct']):+.2f} pt" for k, s in r["sensitivity"].items())
    lines.append(f"  sensitivity (goodput at 150% minus at 50% of each input): {swings}; most sensitive: "
                 f"{r['most_sensitive']}")
    return "\n".join(lines)


def report_json(r: dict[str, Any]) -> str:
    """JSON (strict: an infinite figure, e.g. the MTBF without failures, is null)."""
    def finite(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: finite(w) for k, w in v.items()}
        return None if isinstance(v, float) and not math.isfinite(v) else v
    return json.dumps(finite(r), indent=2)
