"""Pre-flight health check: find a slow or faulty device before a run spends hours waiting on it.

`fault.preflight=true` runs it when `llama-jax train` starts, before the step compiles or a checkpoint
restores; `llama-jax doctor` runs it alone. Big fleets hold bad hardware (Llama 3 405B's team found GPUs
that degrade early, uncorrectable memory errors, flaky links): one slow device slows every synchronous
step of the whole run, and one that computes wrong results poisons the model without a sound. So:

1. Each process measures each of its devices, one device at a time (simulated CPU devices share the
   host's cores, and one device's figure must not depend on what the others do): its matmul rate (bf16
   on accelerators, fp32 on CPU), its memory bandwidth (elementwise passes over an array larger than the
   caches), and a matmul whose exact product is known: small integers, exact in fp32 and in bf16 with
   fp32 accumulation, compared with the host's product.
2. The run's collectives: an all-reduce (psum) over each mesh axis of size > 1 of the run's own mesh, as
   bus bandwidth (NCCL's convention: 2(n-1)/n x the bytes per device / time, so axes of different sizes
   compare), timed by the slowest process. One figure per axis; reported, not judged.
3. Every process's figures are gathered (Peers.reduce, every wait bounded) and judged alike on every
   process. A device whose product is wrong is named at once. One whose matmul rate or memory bandwidth is
   below fault.preflight_min_ratio x the fleet's median is a suspect: the hosts were measured at different
   moments, and one of them may just have been busy. fleet_rounds.py measures the suspects again in a few
   rounds that every process runs at the same moments, and names those slow in most rounds; a host that
   was slow in one round and not in most is reported as loaded during the check, not excluded.
4. Each device named comes with its host, process and device id, and the command stops with
   UnhealthyDevice (exit 71). Process 0 also writes the verdict, with each suspect's per-round ratios, to
   <run.dir>/unhealthy.json: `llama-jax supervise` reads it (srun may report a task it killed rather than
   the 71) and launch/slurm.sbatch resubmits the job without the hosts it names.

The work is bounded by design: fixed sizes per platform, one warm-up call and TIMED_ROUNDS timed calls
per device, then at most SECOND_LOOK_ROUNDS pairs of calls for a device that looks slow beside the
process's others (a second look, timed next to a reference device so that load from elsewhere cancels;
see best_times). Each round visits every device in turn and a device keeps its best time, so load from
elsewhere slows a round of every device rather than every call of one device. The tiny preset's check
on 8 simulated CPU devices takes about 2 s; the GPU sizes aim at a few tens of milliseconds per timed
call on an H100. Suspects add fleet_rounds.py's rounds: about a second each (their pauses), two or three.
For tests and drills only, an Injector (inject.py: inject.slow_device, inject.wrong_device) makes one device's
timed calls do SLOW_FACTOR times the work, or adds one to an element of its known product.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from llama_jax.config import Config
from llama_jax.distributed.peers import Peers
from llama_jax.distributed.processes import node_name
from llama_jax.errors import EXIT_UNHEALTHY, UNHEALTHY_FILE, UnhealthyDevice
from llama_jax.files import atomic_path, format_ranges
from llama_jax.perf.hardware import matmul_operands
from llama_jax.resilience import fleet_rounds
from llama_jax.resilience.inject import NO_INJECTION, Injector

TIMED_ROUNDS = 3
SECOND_LOOK_ROUNDS = 5


@dataclass(frozen=True)
class Sizes:
    """How much work each measurement does on one platform; fixed, so the check's time is bounded."""

    matmul_n: int  # side of the square matmul
    matmul_chain: int  # matmuls chained in one timed call (long enough to time, short enough to be quick)
    stream_mib: int  # the array streamed through memory: larger than the caches
    stream_passes: int  # read-and-write passes over it in one timed call
    check_n: int  # side of the known product (host float64 computes it once: kept small)
    collective_mib: int  # all-reduce buffer per device


SIZES = {
    "cpu": Sizes(matmul_n=512, matmul_chain=16, stream_mib=32, stream_passes=8, check_n=256, collective_mib=4),
    "gpu": Sizes(matmul_n=8192, matmul_chain=16, stream_mib=1024, stream_passes=32, check_n=1024, collective_mib=64),
}


@dataclass(frozen=True)
class Report:
    """The fleet's figures and the verdict, identical on every process."""

    devices: list[dict]  # per device: host, process, device, matmul_flops, memory_bytes_s, arithmetic_ok
    collectives: dict[str, float]  # mesh axis -> all-reduce bus bandwidth, bytes/s
    medians: dict[str, float]  # matmul_flops, memory_bytes_s over every device of the fleet
    unhealthy: list[dict]  # the devices named, each with its `reasons`
    suspects: list[dict]  # the devices measured again (fleet_rounds.py): per-round ratios, whether named
    loaded: list[dict]  # hosts loaded during the check: every device slow in some round, none named; not excluded
    min_ratio: float
    seconds: float  # this process's time for the whole check

    @property
    def healthy(self) -> bool:
        return not self.unhealthy

    @property
    def hosts(self) -> list[str]:
        return sorted({d["host"] for d in self.unhealthy})


def _timed(call, repeats: int) -> float:
    """Seconds for `repeats` calls, one after another (XLA:CPU would run independent calls side by side)."""
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(call())
    return time.perf_counter() - start


class Probe:
    """This process's devices and the programs that time them, compiled once: the first look and the rounds of
    fleet_rounds.py time the same calls. `injector` (inject.py, testing only): an injected slow or wrong device."""

    def __init__(self, devices: list, sizes: Sizes, injector: Injector = NO_INJECTION):
        self.devices, self.sizes, self.injector = devices, sizes, injector
        self.dtype = jnp.bfloat16 if devices[0].platform != "cpu" else jnp.float32
        n, chain, self.elements = sizes.matmul_n, sizes.matmul_chain, sizes.stream_mib * 2**20 // 4
        # The matmul's operands: drawn on the host once, copied to every device; b keeps the chain's magnitude.
        a, b = matmul_operands(n, self.dtype)
        # One program each, which jit compiles once per device (in the warm-up below).
        self.matmul = jax.jit(lambda x, y: lax.fori_loop(0, chain, lambda _, z: z @ y, x))
        # The array is made inside the call, so nothing that large is held between calls (8 CPU devices share RAM).
        self.stream = jax.jit(
            lambda s: lax.fori_loop(
                0, sizes.stream_passes, lambda _, z: z * 0.5 + 0.25, jnp.full((self.elements,), 1.0, jnp.float32) * s
            )
        )
        self.inputs = {
            d.id: (jax.device_put(a, d), jax.device_put(b, d), jax.device_put(np.float32(1.0), d)) for d in devices
        }
        for x, y, s in self.inputs.values():  # warm-up: compilation and first-touch allocation are not timed
            jax.block_until_ready((self.matmul(x, y), self.stream(s)))

    def time_once(self, d) -> tuple[float, float]:
        """Seconds of one matmul call and one stream call on device d."""
        x, y, s = self.inputs[d.id]
        repeats = self.injector.repeats(d.id)
        return _timed(lambda: self.matmul(x, y), repeats), _timed(lambda: self.stream(s), repeats)

    def rates(self, seconds: tuple[float, float]) -> dict[str, float]:
        """(matmul, stream) seconds of one call each -> matmul_flops, memory_bytes_s."""
        sizes = self.sizes
        return {
            "matmul_flops": 2 * sizes.matmul_n**3 * sizes.matmul_chain / seconds[0],
            "memory_bytes_s": 2 * 4 * self.elements * sizes.stream_passes / seconds[1],
        }

    def rate_once(self, device_id: int) -> dict[str, float]:
        """One timed call of each on a device of this process, as rates: what each round of fleet_rounds.py takes."""
        return self.rates(self.time_once(next(d for d in self.devices if d.id == device_id)))

    def figures(self, min_ratio: float) -> list[dict]:
        """The first look: one dict per device, its best rates (best_times) and its known product's check."""
        best = best_times(self.devices, self.time_once, min_ratio)
        check_n = self.sizes.check_n
        rng = np.random.default_rng(0)
        known_a, known_b = (rng.integers(-2, 3, (check_n, check_n)) for _ in range(2))
        expected = known_a.astype(np.float64) @ known_b.astype(np.float64)  # |entries| <= 4 n: exact in fp32
        known_a, known_b = known_a.astype(self.dtype), known_b.astype(self.dtype)  # small integers: exact in bf16
        product = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
        host, figures = node_name(), []
        for d in self.devices:
            result = self.injector.product(d.id, product(jax.device_put(known_a, d), jax.device_put(known_b, d)))
            mismatches = int(np.count_nonzero(np.asarray(result, np.float64) != expected))
            figures.append(
                {"host": host, "process": jax.process_index(), "device": d.id, "kind": d.device_kind}
                | self.rates(best[d])
                | {"arithmetic_ok": mismatches == 0, "wrong_elements": mismatches, "checked_elements": expected.size}
            )
        return figures


def best_times(devices: list, time_once, min_ratio: float) -> dict:
    """Each device's best (matmul, stream) seconds; time_once(device) times one call of each.

    TIMED_ROUNDS rounds visit every device in turn, and a device keeps its best time. A device that still
    looks slow beside this process's median (below min_ratio of its rate) gets a second look:
    SECOND_LOOK_ROUNDS pairs of calls, a reference device (the process's median one) timed just before it.
    Load from elsewhere on the host (other processes on a CPU, a neighbour's burst) slows both calls of a
    pair alike, so the ratio of a pair's times is the device's own speed beside the reference; its time is
    then the reference's best time over the median pair's ratio. A slow device is slow in every pair and
    stays named: 10x slow under load that varies up to 2x between calls still comes out at least 5x slow."""
    best = {d: [float("inf"), float("inf")] for d in devices}
    for _ in range(TIMED_ROUNDS):
        for d in devices:
            best[d] = [min(b, t) for b, t in zip(best[d], time_once(d))]
    medians = [statistics.median(times[k] for times in best.values()) for k in (0, 1)]
    suspects = [d for d in devices if any(best[d][k] * min_ratio > medians[k] for k in (0, 1))]
    others = [d for d in devices if d not in suspects]
    if not suspects or not others:
        return best
    reference = min(others, key=lambda d: abs(best[d][0] - medians[0]))
    for d in suspects:
        pairs = [(time_once(reference), time_once(d)) for _ in range(SECOND_LOOK_ROUNDS)]
        for k in (0, 1):  # the median pair: a change of load between a pair's two calls moves one pair only
            ratio = statistics.median(ref[k] / own[k] for ref, own in pairs)  # reference's time / the device's
            best[d][k] = min(best[d][k], best[reference][k] / ratio)
    return best


def measure_collectives(mesh: Mesh, sizes: Sizes) -> dict[str, float]:
    """Seconds (best of TIMED_ROUNDS) of an all-reduce over each mesh axis of size > 1, seen from this process."""
    elements = sizes.collective_mib * 2**20 // 4
    spec = PartitionSpec(mesh.axis_names)  # one block per device
    sharding = NamedSharding(mesh, spec)
    x = jax.make_array_from_callback(
        (mesh.devices.size * elements,), sharding, lambda index: np.ones(elements, np.float32)
    )
    seconds = {}
    for axis, size in mesh.shape.items():
        if size == 1:
            continue
        reduce = jax.jit(
            jax.shard_map(lambda v, axis=axis: lax.psum(v, axis), mesh=mesh, in_specs=spec, out_specs=spec)
        )
        jax.block_until_ready(reduce(x))
        seconds[axis] = min(_timed(lambda reduce=reduce: reduce(x), 1) for _ in range(TIMED_ROUNDS))
    return seconds


def judge(devices: list[dict], min_ratio: float) -> tuple[dict[str, float], list[dict]]:
    """(fleet medians, the unhealthy devices with their reasons): the same on every process."""
    medians = {m: statistics.median(d[m] for d in devices) for m in ("matmul_flops", "memory_bytes_s")}
    unhealthy = []
    for d in devices:
        reasons = [
            f"{label} {_rate(d[m], unit)}, {d[m] / medians[m]:.2f}x the median {_rate(medians[m], unit)}"
            for m, label, unit in (("matmul_flops", "matmul", "FLOP/s"), ("memory_bytes_s", "memory", "B/s"))
            if d[m] < min_ratio * medians[m]
        ]
        if not d["arithmetic_ok"]:
            reasons.append(
                f"wrong matmul result ({d['wrong_elements']} of {d['checked_elements']} elements differ "
                "from the exact product)"
            )
        if reasons:
            unhealthy.append(d | {"reasons": reasons})
    return medians, unhealthy


def check(
    config: Config,
    mesh: Mesh,
    peers: Peers,
    print_fn: Callable[[str], None] = lambda line: None,
    injector: Injector | None = None,
) -> Report:
    """Measure this process's devices and the mesh's collectives, gather every process's figures and judge
    them, measure the slow ones again in rounds (fleet_rounds.py); every process returns the same Report. `print_fn`:
    where the note that the rounds begin goes; `injector`: the run's (testing only), else one from the config.
    Raises ConfigError for an injected device id not in the mesh."""
    start, f = time.perf_counter(), config.fault
    injector = injector or Injector(config.inject, jax.process_index())
    injector.check_devices(sorted(d.id for d in mesh.devices.flat))
    mine = sorted((d for d in mesh.devices.flat if d.process_index == jax.process_index()), key=lambda d: d.id)
    sizes = SIZES["cpu" if (mine or jax.local_devices())[0].platform == "cpu" else "gpu"]
    peers.barrier("pre-flight check")  # every process measures at the same time: the collectives need them all
    probe = Probe(mine, sizes, injector) if mine else None  # none: a process with no device in the mesh
    figures = probe.figures(f.preflight_min_ratio) if probe else []
    seconds = measure_collectives(mesh, sizes)
    gathered = peers.reduce("pre-flight figures", {"devices": figures, "collectives": seconds}, _merge)
    devices = sorted(gathered["devices"], key=lambda d: d["device"])
    medians, flagged = judge(devices, f.preflight_min_ratio)
    slow = {d["device"] for d in flagged if d["arithmetic_ok"]}  # a wrong product is named at once: it is no accident
    rechecked = fleet_rounds.Recheck([], [], 0)
    if slow:
        print_fn(
            f"pre-flight check: {_devices(d for d in devices if d['device'] in slow)} below "
            f"{f.preflight_min_ratio:g}x the median; measuring again in up to {fleet_rounds.ROUNDS} rounds, "
            f"{fleet_rounds.ROUND_GAP_S:g} s apart, on every process at once"
        )
        rate_once = probe.rate_once if probe else None  # a process with no device measures none
        rechecked = fleet_rounds.recheck(devices, slow, rate_once, peers, f.preflight_min_ratio, medians)
    records = {r["device"]: r for r in rechecked.suspects}
    unhealthy = [
        d
        | (
            {"reasons": d["reasons"] + [_rounds_reason(records[d["device"]])], "ratios": records[d["device"]]["ratios"]}
            if d["device"] in records
            else {}
        )
        for d in flagged
        if d["device"] not in slow or d["device"] in rechecked.named
    ]
    collectives = {
        axis: 2 * (mesh.shape[axis] - 1) / mesh.shape[axis] * sizes.collective_mib * 2**20 / s
        for axis, s in gathered["collectives"].items()
    }
    return Report(
        devices,
        collectives,
        medians,
        unhealthy,
        suspects=rechecked.suspects,
        loaded=rechecked.loaded,
        min_ratio=f.preflight_min_ratio,
        seconds=time.perf_counter() - start,
    )


def _devices(devices) -> str:
    """'device 0 (process 0 on node-a), device 5 (process 1 on node-b)'."""
    return ", ".join(f"device {d['device']} (process {d['process']} on {d['host']})" for d in devices)


def _rounds_reason(record: dict) -> str:
    """Why a suspect was named: 'slow in 2 of 2 rounds measured again (matmul 0.09x, 0.1x; memory ...)'."""
    ratios = "; ".join(
        f"{name} {', '.join(f'{r:.2g}x' for r in values[1:])}" for name, values in record["ratios"].items()
    )
    return (
        f"slow in {len(record['slow_rounds'])} of {record['rounds']} rounds measured again ({ratios} the "
        "round's median)"
    )


def _merge(values: list[dict]) -> dict:
    """Process 0's combination: every device, and each axis's time on the slowest process."""
    axes = values[0]["collectives"]
    return {
        "devices": [d for v in values for d in v["devices"]],
        "collectives": {a: max(v["collectives"][a] for v in values) for a in axes},
    }


def enforce(report: Report, run_dir: Path, create: bool, peers: Peers) -> None:
    """Raise UnhealthyDevice when the report names a device, process 0 first writing run_dir/unhealthy.json:
    into a new run.dir when `create` (a run that was starting anyway), else only into one that exists. Every
    process waits for the file: exiting first, one would have srun kill process 0 before it is written."""
    if report.healthy:
        return
    written = create or run_dir.is_dir()  # what process 0 decides: run.dir is on a filesystem they all see
    if jax.process_index() == 0 and written:
        run_dir.mkdir(parents=True, exist_ok=True)
        verdict = {
            "exit_code": EXIT_UNHEALTHY,
            "hosts": report.hosts,
            "devices": report.unhealthy,
            "medians": report.medians,
            "min_ratio": report.min_ratio,
            "suspects": report.suspects,
            "loaded": report.loaded,
            "time": time.time(),
        }
        with atomic_path(run_dir / UNHEALTHY_FILE) as tmp:
            tmp.write_text(json.dumps(verdict, indent=1) + "\n")
    peers.barrier("pre-flight verdict written")
    named = "; ".join(
        f"device {d['device']} (process {d['process']} on {d['host']}): {', '.join(d['reasons'])}"
        for d in report.unhealthy
    )
    several = len(report.hosts) > 1
    raise UnhealthyDevice(
        f"pre-flight check: {named}; exclude host{'s' * several} {', '.join(report.hosts)} and "
        f"start again (launch/slurm.sbatch resubmits without {'them' if several else 'it'}; "
        f"fault.preflight_min_ratio={report.min_ratio:g}"
        f"{f'; the verdict: {run_dir / UNHEALTHY_FILE}' if written else ''})"
    )


def _rate(value: float, unit: str) -> str:
    """1.2e14 FLOP/s -> '120 TFLOP/s'; 4.5e10 B/s -> '45 GB/s'."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def cleared(report: Report) -> list[dict]:
    """The suspects that the rounds cleared: slow in the first look, not in most rounds."""
    return [s for s in report.suspects if not s["named"]]


def loaded_note(host: dict) -> str:
    """Why a host that looked slow is not excluded."""
    when = ", ".join("the first look" if i == 0 else f"round {i}" for i in host["loaded_rounds"])
    several = len(host["processes"]) > 1
    return (
        f"host {host['host']} (process{'es' * several} {format_ranges(host['processes'])}) was loaded during the "
        f"check: every device slow in {when}, not in most of the {host['rounds']} rounds measured again; not "
        "excluded"
    )


def summary(report: Report) -> str:
    """One line for the train log."""
    medians = report.medians
    axes = ", ".join(f"{a} {_rate(b, 'B/s')}" for a, b in report.collectives.items()) or "none (one device per axis)"
    verdict = "healthy" if report.healthy else f"checked, {len(report.unhealthy)} unhealthy"
    rounds = max((s["rounds"] for s in report.suspects), default=0)
    notes = (
        [f"{_devices(cleared(report))} slow at first, cleared in {rounds} rounds measured again"]
        if cleared(report)
        else []
    ) + [loaded_note(h) for h in report.loaded]
    return (
        f"pre-flight check: {len(report.devices)} devices {verdict} in {report.seconds:.1f}s; medians: matmul "
        f"{_rate(medians['matmul_flops'], 'FLOP/s')}, memory {_rate(medians['memory_bytes_s'], 'B/s')}; "
        f"all-reduce {axes}" + "".join(f"; {note}" for note in notes)
    )


def format_report(report: Report) -> str:
    """`llama-jax doctor`'s table: every device, the medians, every mesh axis, the verdict."""

    def figures(d: dict) -> str:
        return f"{_rate(d['matmul_flops'], 'FLOP/s'):>15} {_rate(d['memory_bytes_s'], 'B/s'):>13}"

    lines = [f"{'host':<20} {'process':>7} {'device':>6} {'matmul':>15} {'memory':>13}  arithmetic"]
    notes = {d["device"]: "  <- unhealthy" for d in report.unhealthy}
    notes |= {
        s["device"]: f"  <- slow at first; slow in {len(s['slow_rounds'])} of {s['rounds']} rounds measured "
        "again: cleared"
        for s in cleared(report)
    }
    for d in report.devices:
        lines.append(
            f"{d['host'][:20]:<20} {d['process']:>7} {d['device']:>6} {figures(d)}  "
            f"{'ok' if d['arithmetic_ok'] else 'WRONG'}{notes.get(d['device'], '')}"
        )
    lines.append(f"{'median':<36} {figures(report.medians)}")
    lines += [
        f"all-reduce over mesh axis {a}: {_rate(b, 'B/s')} (bus bandwidth)" for a, b in report.collectives.items()
    ]
    if report.healthy:  # the summary carries the notes on suspects
        lines.append(summary(report).removeprefix("pre-flight check: "))
    else:
        lines += [loaded_note(h) for h in report.loaded]
        ids = [str(d["device"]) for d in report.unhealthy]
        lines.append(
            f"UNHEALTHY (below {report.min_ratio:g}x the median, or a wrong product): "
            f"device{'s' * (len(ids) > 1)} {', '.join(ids)} on {', '.join(report.hosts)}"
        )
    return "\n".join(lines)


def report_json(report: Report) -> str:
    return json.dumps(asdict(report) | {"healthy": report.healthy, "hosts": report.hosts}, indent=2)
