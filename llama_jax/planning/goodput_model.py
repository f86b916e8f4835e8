"""The goodput projection's model: from stated Inputs, the expected effective training time (goodput) of a run
under failures, where the rest of the wall time goes, and the checkpoint intervals that maximise it
(goodput_projection.py finds the inputs, goodput_report.py prints the report).

The model (every choice here is a first-order one, stated where it is made):
- Failures arrive as a Poisson process over wall time, at `failures_per_gpu_hour` x GPUs (unexpected ones, split
  into kinds by `mix`) plus `planned_per_gpu_hour` x GPUs preemptions. Failures during recovery count too: they
  are part of the wall time the rate applies to.
- Each failure of kind k costs F_k seconds: detection (a crash: the heartbeat timeout plus the supervisor's
  backoff; a hang: the watchdog's timeout), a replacement host when it loses one, restart to the first step
  (the scheduler's relaunch, process start, distributed initialisation, compile), the restore of the tier that
  serves it, and the progress lost since that tier's newest checkpoint.
- A tier saving every n steps holds, at a failure at a uniformly random time, a newest checkpoint n/2 steps old
  on average, plus its commit latency (a save counts once its write is done: an asynchronous durable write, the
  local tier's background write). With two tiers the newest of either serves (mean age of the union of both
  step sequences, computed exactly over their common period).
- A lost host is the job's first host 1 / hosts of the time. Under slurm.sbatch that host runs the batch script and
  its supervisor, so nothing in the job notices until Slurm marks the host DOWN; then the job is ended (the watch,
  slurm_guard.sh) and the successor job (slurm.sbatch's) starts; that case's detection is first_host_detect_s (0:
  as any other host's).
- A lost host is replaced by a hot spare already in the allocation when one is free (no wait: the restart runs on
  it), else by a host from the scheduler's pool (replacement_s). A spare taken is back repair_s later (the lost
  host repaired, or another in its place); a loss that finds none free takes the scheduler's host and no spare.
  That is Erlang's loss system: `spare_hosts` servers, losses arriving at the host-loss rate, each holding a spare
  for repair_s; a loss finds none free with Erlang B's probability (1 without spares). Spares not given are the
  count that trains the most per GPU allocated (best_spares): each spare is a host that waits instead of training.
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
import math
from dataclasses import dataclass, field

from llama_jax.checkpoint.interval import auto_checkpoint_steps

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
    restart_s: float  # the scheduler's relaunch, process start, distributed init, compile, to the first step
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
    spare_hosts: int = 0  # hot spares in the allocation (slurm.sbatch --spares)
    repair_s: float = 0.0  # a lost host's time until it (or its replacement) is a spare again
    first_host_detect_s: float = 0.0  # a lost first host: until the successor job's processes start (0: as any)
    restart_parts: dict[str, float] = field(default_factory=dict)  # what restart_s adds up, where it is a sum
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def hosts(self) -> int:
        return max(1, self.gpus // self.gpus_per_host)

    @property
    def failure_rate_s(self) -> float:
        """Interruptions (unexpected and planned) per second of wall time, for the whole job."""
        return (self.failures_per_gpu_hour + self.planned_per_gpu_hour) * self.gpus / 3600

    @property
    def host_loss_rate_s(self) -> float:
        """Failures that lose a host, per second of wall time, for the whole job."""
        host = sum(self.mix.get(k, 0) for k in LOSES_HOST) / (sum(self.mix.values()) or 1)
        return self.failures_per_gpu_hour * self.gpus / 3600 * host

    @property
    def no_spare_chance(self) -> float:
        """The chance a lost host finds every hot spare taken: Erlang B for spare_hosts spares and an offered load
        of host-loss rate x repair_s, by its recurrence (no factorials: any number of spares). 1 without spares."""
        load, blocked = self.host_loss_rate_s * self.repair_s, 1.0
        for spares in range(1, self.spare_hosts + 1):
            blocked = load * blocked / (spares + load * blocked)
        return blocked

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
        return dataclasses.replace(
            x, durable_every=0 if x.durable_auto else x.durable_every, local_every=0 if x.local_auto else x.local_every
        )  # no failures: save at the end
    durable = (
        auto_checkpoint_steps(x.save_durable_s, mtbf_s, x.step_s, x.write_durable_s)
        if x.durable_auto
        else x.durable_every
    )
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
        return short / 2 - short**2 / (6 * long_)
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
    per_failure = failure_costs(x, nd, nl)
    shares = x.shares()
    rate = x.failure_rate_s
    components = ("detect", "replacement", "restart", "restore", "lost", "checkpoint_save")
    mean = {c: sum(shares[k] * per_failure[k][c] for k in KINDS) for c in components}
    save_overhead = _save_overhead(nd, x.save_durable_s, x.write_durable_s, x.step_s) + _save_overhead(
        nl, x.save_local_s, x.write_local_s, x.step_s
    )
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


def _save_overhead(every: int, save_s: float, write_s: float, step_s: float) -> float:
    """Seconds a tier saving every `every` steps blocks the loop per productive second. A save blocks for its
    copy, and also waits for the previous save's write when that is still running (checkpoint/interval.py: the
    interval is never shorter than one write)."""
    return (save_s + max(0.0, write_s - every * step_s)) / (every * step_s) if every else 0.0


def failure_costs(x: Inputs, nd: int, nl: int) -> dict[str, dict[str, float]]:
    """What one failure of each kind costs with a durable save every `nd` steps and a local one every `nl` (0:
    none), in seconds by component: detect, replacement, restart, restore, lost, checkpoint_save."""
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
    host_loss_per_host_s = x.host_loss_rate_s / x.hosts

    def restore(host_lost: bool, window: float) -> tuple[float, float, float]:
        """(restore seconds, lost seconds, the served tier's interval in seconds) for a restart."""
        if nl and not host_lost:
            return x.restore_local_s, union_age, (min(nl, nd) if nd else nl) * x.step_s
        if host_lost and partner:
            survives = math.exp(-host_loss_per_host_s * window)
            return (
                survives * x.restore_local_s + (1 - survives) * x.restore_durable_s,
                survives * union_age + (1 - survives) * durable_age,
                (min(nl, nd) if nd else nl) * x.step_s,
            )
        return x.restore_durable_s, durable_age, (nd * x.step_s if nd else no_checkpoint_age)

    per_failure: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        host_lost = kind in LOSES_HOST
        detect = {"hang": x.hang_detect_s, "preemption": 0.0}.get(kind, x.detect_s)
        if kind == "host_lost" and x.first_host_detect_s:  # the first host, 1 / hosts of them: no supervisor left
            detect += (x.first_host_detect_s - detect) / x.hosts
        replacement = x.replacement_s * x.no_spare_chance if host_lost else 0.0
        restart = x.restart_s * (2 if kind == "slow_device" else 1)  # a first start that pre-flight refuses
        restore_s, lost, interval = restore(host_lost, detect + replacement + restart)
        if kind == "damaged_checkpoint":  # the newest is set aside after a failed read: one interval further back
            restore_s, lost = 2 * restore_s, min(lost + interval, no_checkpoint_age)
        save = 0.0
        if kind == "preemption":  # SIGTERM: the step is saved (and written) before the exit, nothing is lost
            restore_s, lost, save = x.restore_durable_s, 0.0, x.save_durable_s + x.write_durable_s
        per_failure[kind] = {
            "detect": detect,
            "replacement": replacement,
            "restart": restart,
            "restore": restore_s,
            "lost": lost,
            "checkpoint_save": save,
        }
    return per_failure


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


def best_spares(x: Inputs, most: int = 4096) -> int:
    """The hot spares that train the most per GPU allocated: goodput x hosts / (hosts + spares), for each spare is a
    host held idle. Erlang B falls ever more slowly with each spare while a spare's cost stays one host, so the
    first spare that gains nothing marks the best count."""
    per_allocated = lambda s: project(dataclasses.replace(x, spare_hosts=s)).goodput * x.hosts / (x.hosts + s)  # noqa: E731
    best, value = 0, per_allocated(0)
    while best < most and (next_value := per_allocated(best + 1)) > value:
        best, value = best + 1, next_value
    return best


SENSITIVE = (
    "failures_per_gpu_hour",
    "step_s",
    "save_durable_s",
    "save_local_s",
    "write_durable_s",
    "restart_s",
    "restore_durable_s",
    "restore_local_s",
    "detect_s",
    "replacement_s",
)


def sensitivity(x: Inputs, names: tuple[str, ...] = SENSITIVE) -> dict[str, tuple[float, float]]:
    """name -> (goodput with that input at 50%, at 150%), everything else as it is; automatic intervals follow the
    changed input, as the trainer's would."""
    return {
        n: (project(with_auto(x.scaled(n, 0.5))).goodput, project(with_auto(x.scaled(n, 1.5))).goodput) for n in names
    }
