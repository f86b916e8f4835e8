"""Rehearsal: a llama3_* preset's recipe under Llama 3's failure mix, on N local processes, next to the same run left
alone, with the goodput measured and projected (`llama-jax goodput`) from the rehearsal's own costs.

    .venv/bin/python bench/rehearsal.py --preset llama3_8b --processes 2 --seed 0 --failures-per-hour 60 \\
        [--steps 1500] [--devices 2] [--work DIR] [--json OUT]

The recipe: the preset with only the model's sizes shrunk to CPU (and the run's shape: batch, sequence, steps and
warmup at the recipe's 1%), every other key as the preset sets it, plus what the cluster launchers add
(launch/defaults.sh: the node-local tier with partner copies, every_steps=auto, pre-flight). It trains on a token
store of the bundled Shakespeare with its own small BPE (a llama3_* preset refuses to run without data named),
under `llama-jax supervise` around launch/multiprocess.py (N processes as N hosts, --devices simulated CPU
devices each). Time is scaled so that a few minutes see several faults: checkpoint.mtbf_hours = 1 / the fault
rate (what a user states for their cluster), the supervisor's backoff 1 s and reset-after 60 s and the launcher's
grace 9 s (their defaults / 10),
run.heartbeat_timeout_s 10 (/ 3); and fault.preflight_min_ratio 0.5, since simulated devices sharing two busy cores
measure 0.8x the median by chance (the injected slow device runs 10x over: 0.1x).

Faults: after the run is training (the newest attempt has timed a step), wait an exponentially distributed time
(mean 3600 / --failures-per-hour seconds, seeded), then inject the next fault into a random process. The first six
faults are the six kinds in a seeded order, so a short rehearsal sees each once; later ones are drawn from
Llama 3's mix (llama_jax/planning/goodput_model.py: LLAMA3_MIX, plus its 47 planned interruptions):
    crash               SIGKILL a trainer (software bug)
    hang                SIGSTOP a trainer: its peers' heartbeat (or watchdog, barriers) must end the attempt
    host_lost           SIGKILL a trainer and delete its node-local directory: its partner's copy must serve
    slow_device         SIGKILL process 0; its host comes back with a slow device 0 (inject.slow_device):
                        pre-flight refuses the restart (exit 71), and the rehearsal, as a scheduler, replaces the
                        host (the recipe without the injection) and relaunches the job
    damaged_checkpoint  SIGKILL a trainer and damage the newest checkpoint in every tier holding it
    preemption          SIGTERM to the job (the supervisor): it saves and stops (exit 75); relaunched

Prints the goodput measured (goodput.json) with its breakdown, the time lost per failure kind (the restart,
compile, restore and redone steps of the attempt each fault led to), the projection fed this rehearsal's measured
costs and realised fault rate and mix, and whether the final parameters equal the uninterrupted run's bitwise.
The last line is a JSON object with goodput_measured, goodput_projected and params_bitwise_equal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos import LLAMA_JAX, MULTIPROCESS, compare, environment, trainer_pid  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("crash", "hang", "host_lost", "slow_device", "damaged_checkpoint", "preemption")
# CPU sizes: the model (as tests/test_multihost.py shrinks llama3_8b) and the run's shape.
SHRUNK = [
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.head_dim=16",
    "model.ffn_dim=128",
    "model.vocab_size=320",
    "model.compute_dtype=float32",
    "train.batch_size=8",
    "train.seq_len=32",
]


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True, help="a llama3_* preset")
    parser.add_argument("--processes", type=int, required=True, help="processes (hosts), e.g. 2 or 4")
    parser.add_argument("--seed", type=int, default=0, help="seeds the fault schedule")
    parser.add_argument(
        "--failures-per-hour",
        type=float,
        required=True,
        help="mean fault rate while training (CPU: 30-120 so a few minutes see several)",
    )
    parser.add_argument("--steps", type=int, default=1500, help="train.steps of the shrunk recipe")
    parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices per process")
    parser.add_argument("--max-faults", type=int, default=0, help="stop injecting after this many (0: no limit)")
    parser.add_argument("--work", help="keep everything here; an uninterrupted run already there is reused")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    if not args.preset.startswith("llama3_"):
        parser.error(f"--preset {args.preset}: a rehearsal runs a llama3_* preset's recipe")
    if args.processes < 2 or args.devices < 1 or args.steps < 20 or args.failures_per_hour <= 0 or args.max_faults < 0:
        parser.error(
            "--processes must be >= 2 (a partner copy needs another host), --devices >= 1, --steps >= 20, "
            "--failures-per-hour > 0, --max-faults >= 0"
        )
    return args


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, env=environment(), capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        sys.exit(f"failed (exit {proc.returncode}): {' '.join(command)}\n{proc.stderr[-3000:]}")
    return proc


def launcher_defaults(local_dir: Path) -> list[str]:
    """The keys launch/defaults.sh adds to every training command (the node-local tier, pre-flight)."""
    script = 'source "$1"; shift; train_args "$@"; printf "%s\\0" "${TRAIN_ARGS[@]}"'
    out = subprocess.run(
        ["bash", "-c", script, "_", str(ROOT / "launch" / "defaults.sh")],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, LLAMA_JAX_LOCAL_DIR=str(local_dir)),
    ).stdout
    return [a for a in out.split("\0") if a]


def write_recipes(args, work: Path) -> tuple[Path, Path, Path]:
    """(recipe.yaml, the same with one device slow at pre-flight, the local tier's directory)."""
    store, local_dir = work / "store", work / "local"
    if not (store / "meta.json").exists() and not any(store.glob("*")):
        run(
            [*LLAMA_JAX, "prepare", "shakespeare", "--out", str(store), "--train-tokenizer", "300", "--workers", "1"],
            timeout=600,
        )
    keys = [
        *launcher_defaults(local_dir),
        *SHRUNK,
        f"train.steps={args.steps}",
        f"train.warmup_steps={max(1, args.steps // 100)}",
        f"data.sources=[{store}]",
        f"data.cache_dir={work / 'cache'}",
        f"run.compilation_cache={work / 'jax_cache'}",
        "run.tensorboard=false",
        f"checkpoint.mtbf_hours={1 / args.failures_per_hour:.6g}",
        "run.heartbeat_timeout_s=10",
        "fault.preflight_min_ratio=0.5",
    ]
    recipe, slow = work / "recipe.yaml", work / "recipe-slow-device.yaml"
    for path, extra in ((recipe, []), (slow, ["inject.slow_device=0"])):
        printed = run([*LLAMA_JAX, "train", args.preset, *keys, *extra, "--print-config"]).stdout
        path.write_text(printed)
    return recipe, slow, local_dir


def multiprocess(args) -> list[str]:
    return [
        sys.executable,
        str(MULTIPROCESS),
        "--processes",
        str(args.processes),
        "--devices",
        str(args.devices),
        "--grace",
        "9",
        "--",
    ]


def attempts_of(run_dir: Path) -> list[dict]:
    try:
        return json.loads((run_dir / "goodput.json").read_text())["attempts"]
    except (OSError, ValueError, KeyError):
        return []


class Rehearsal:
    """The supervised run under the fault schedule; the rehearsal itself is the scheduler that relaunches the job
    after a preemption or a pre-flight refusal (a replaced host)."""

    def __init__(self, args, work: Path, recipe: Path, slow: Path, local_dir: Path):
        from llama_jax.checkpoint.local_files import process_directory

        self.args, self.recipe, self.slow = args, recipe, slow
        self.clean = recipe.read_text()
        self.run_dir = work / "rehearsal"
        self.local_dirs = [process_directory(str(local_dir), self.run_dir, i) for i in range(args.processes)]
        self.rng = random.Random(args.seed)
        self.order = self.rng.sample(KINDS, len(KINDS))
        from llama_jax.planning.goodput_projection import LLAMA3_MIX

        self.mix = {**LLAMA3_MIX, "preemption": 47}
        self.faults: list[dict] = []
        self.replacements = 0  # hosts replaced after a pre-flight refusal
        self.preempted = False  # the running job was sent SIGTERM
        self.log = (work / "rehearsal.log").open("a")

    def next_kind(self) -> str:
        n = len(self.faults)
        return self.order[n] if n < len(self.order) else self.rng.choices(list(self.mix), list(self.mix.values()))[0]

    def supervisor(self) -> subprocess.Popen:
        supervise = [
            *LLAMA_JAX,
            "supervise",
            "--backoff",
            "1",
            "--max-backoff",
            "4",
            "--reset-after",
            "60",
            "--max-restarts",
            "20",
            "--",
        ]
        return subprocess.Popen(
            [*supervise, *multiprocess(self.args), "train", str(self.recipe), f"run.dir={self.run_dir}"],
            env=environment(),
            stdout=self.log,
            stderr=self.log,
        )

    def go(self) -> float:
        start = time.time()
        while True:
            supervisor = self.supervisor()
            self.drive(supervisor)
            code = supervisor.wait()
            if code == 0:
                return time.time() - start
            if code == 71:  # pre-flight named the slow device: the scheduler replaces the host and relaunches
                self.recipe.write_text(self.clean)
                verdict = self.run_dir / "unhealthy.json"  # acted on: moved aside, so the next job does not
                if verdict.exists():  # count it as its own (supervise.py reads a fresh one as exit 71)
                    verdict.rename(self.run_dir / f"unhealthy-{len(self.faults)}-{int(time.time())}.json")
                self.replacements += 1
                continue
            if self.preempted:  # the scheduler requeues a preempted job, however it ended
                self.preempted = False
                continue
            self.log.flush()
            sys.exit(f"the rehearsal's job failed (exit {code}); see {self.log.name}")

    def training(self, supervisor: subprocess.Popen) -> bool:
        """Whether a new attempt (since the last fault) has timed a step; waits while not, False if the job ended."""
        seen = self.faults[-1]["attempts_before"] if self.faults else 0
        while supervisor.poll() is None:
            attempts = attempts_of(self.run_dir)
            if len(attempts) > seen and attempts[-1].get("timed_steps", 0) >= 1:
                return True
            time.sleep(0.1)
        return False

    def drive(self, supervisor: subprocess.Popen) -> None:
        args = self.args
        while self.training(supervisor):
            if args.max_faults and len(self.faults) >= args.max_faults:
                supervisor.wait()
                return
            delay, kind, victim = (
                self.rng.expovariate(args.failures_per_hour / 3600),
                self.next_kind(),
                self.rng.randrange(args.processes),
            )
            victim = 0 if kind == "slow_device" else victim  # device 0's host: process 0 (device ids are JAX's)
            until = time.monotonic() + delay
            while time.monotonic() < until and supervisor.poll() is None:
                time.sleep(0.05)
            pid = trainer_pid(supervisor, victim, args.processes)
            if supervisor.poll() is not None or pid is None:
                return
            newest = attempts_of(self.run_dir)
            if newest and newest[-1].get("highest_step", 0) >= args.steps - 10:
                supervisor.wait()  # the run is finishing: a fault now would hit a finished run, cost nothing counted
                return
            attempts = len(attempts_of(self.run_dir))
            self.inject(kind, supervisor, pid, victim)
            self.faults.append(
                {
                    "kind": kind,
                    "process": victim,
                    "after_s": round(delay, 2),
                    "at": time.time(),
                    "attempts_before": attempts,
                }
            )
            print(f"  fault {len(self.faults)}: {kind} on process {victim} after {delay:.1f}s", flush=True)

    def inject(self, kind: str, supervisor: subprocess.Popen, pid: int, victim: int) -> None:
        if kind == "preemption":
            self.preempted = True
            supervisor.send_signal(signal.SIGTERM)
            return
        if kind == "hang":
            os.kill(pid, signal.SIGSTOP)
            return
        if kind == "slow_device":  # the host that comes back has a slow device (device 0): pre-flight must refuse it
            self.recipe.write_text(self.slow.read_text())
        os.kill(pid, signal.SIGKILL)
        while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
            time.sleep(0.01)
        if kind == "host_lost":
            shutil.rmtree(self.local_dirs[victim], ignore_errors=True)
        if kind == "damaged_checkpoint":
            damage_newest(self.run_dir, self.local_dirs)


def damage_newest(run_dir: Path, local_dirs: list[Path]) -> int | None:
    """Empty every file of the newest step any tier holds (local copies, partner copies, durable shards)."""
    from llama_jax.checkpoint.durable import step_directories
    from llama_jax.checkpoint.local_files import finished_steps

    held: dict[int, list[Path]] = {}
    for directory in local_dirs:
        for step in finished_steps(directory):
            held.setdefault(step, []).append(directory / str(step))
    durable = run_dir / "checkpoints"
    durable_steps = step_directories(durable)
    if not held and not durable_steps:
        return None
    newest = max([*held, *durable_steps])
    for step_dir in held.get(newest, []):
        for file in step_dir.glob("*.safetensors"):
            file.write_bytes(b"")
    if newest in durable_steps:
        for file in (durable / str(newest) / "state").glob("ocdbt.process_*/d/*"):
            file.write_bytes(b"")
    return newest


def lost_per_fault(run_dir: Path, faults: list[dict]) -> list[dict]:
    """Each fault's cost: the attempt it led to (the first started after it): its gap since the failed attempt's
    last sign of life (detection, backoff, relaunch), its start and compile, restore, and the steps it redid."""
    attempts = attempts_of(run_dir)
    costs = []
    for fault in faults:
        index = next((i for i, a in enumerate(attempts) if a["started_at"] > fault["at"]), None)
        if index is None or index == 0:
            continue
        a, previous = attempts[index], attempts[index - 1]
        b = a["buckets"]
        gap = max(0.0, a["started_at"] - previous["last_alive"])
        costs.append(
            {
                "kind": fault["kind"],
                "gap_s": gap,
                "restart_s": b["restart"] + b["compile"],
                "restore_s": b["checkpoint_restore"],
                "lost_s": b["lost"],
                "total_s": b["restart"] + b["compile"] + b["checkpoint_restore"] + b["lost"],
                "restored_from": a.get("restored_from", ""),
                "redone_steps": a.get("redone_steps", 0),
            }
        )
    return costs


def intervals_used(log: Path) -> tuple[int, int]:
    """The automatic intervals the rehearsal's trainer worked out (its last word on each), from its log."""
    text = log.read_text(errors="replace")
    found = [
        re.findall(rf"checkpoint\.{key}=auto: .*? saving every (\d+) steps", text)
        for key in ("every_steps", "local_every_steps")
    ]
    return tuple(int(f[-1]) if f else 0 for f in found)


def projected(args, recipe: Path, run_dir: Path, faults: list[dict], costs: list[dict], log: Path) -> dict:
    """`llama-jax goodput` fed this rehearsal: its measured costs, the realised fault rate and mix, the intervals
    its trainer used; a lost host is replaced at once here (the same machine)."""
    from llama_jax.config import load_config
    from llama_jax.planning import goodput_projection as projection
    from llama_jax.planning.goodput_model import project
    from llama_jax.planning.goodput_report import INPUT_FIELDS
    from llama_jax.resilience.goodput import read_goodput

    config = load_config(str(recipe))
    wall_h = read_goodput(run_dir)["wall_s"] / 3600
    devices = args.processes * args.devices
    kinds = Counter(f["kind"] for f in faults)
    unexpected = sum(n for k, n in kinds.items() if k != "preemption")
    gaps = [c["gap_s"] for c in costs if c["kind"] not in ("hang", "preemption")]
    hang_gaps = [c["gap_s"] for c in costs if c["kind"] == "hang"]
    # launch/multiprocess.py's supervisor outlives every host it loses: no first host lost as under slurm.sbatch.
    given = {"replacement_s": 0.0, "first_host_detect_s": 0.0}
    if gaps:
        given["detect_s"] = statistics.median(gaps)
    if hang_gaps or gaps:  # a stopped process is found by its peers' heartbeat, as a crash is (not the watchdog)
        given["hang_detect_s"] = statistics.median(hang_gaps or gaps)
    x = projection.inputs_for(
        config,
        devices,
        args.devices,
        projection.measured(run_dir),
        failures_per_gpu_hour=unexpected / wall_h / devices,
        planned_per_gpu_hour=kinds["preemption"] / wall_h / devices,
        mix={k: float(kinds[k]) for k in projection.LLAMA3_MIX},
        **given,
    )
    durable, local = intervals_used(log)
    x = dataclasses.replace(
        x,
        durable_every=durable or x.durable_every,
        local_every=local or x.local_every,
        durable_auto=False,
        local_auto=False,
    )
    p = project(x)
    return {
        "goodput": p.goodput,
        "breakdown": p.breakdown,
        "durable_every": x.durable_every,
        "local_every": x.local_every,
        "inputs": {k: getattr(x, k) for k in INPUT_FIELDS},
    }


def main() -> None:
    args = arguments()
    work = Path(args.work or f"/tmp/rehearsal-{args.preset}-{args.processes}p-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    from llama_jax.resilience.goodput import BUCKETS, format_goodput, read_goodput

    print(
        f"rehearsal of {args.preset} on {args.processes} processes x {args.devices} devices, {args.steps} steps, "
        f"{args.failures_per_hour:g} faults/hour, seed {args.seed}; work: {work}",
        flush=True,
    )
    recipe, slow, local_dir = write_recipes(args, work)
    straight = work / "straight"
    done = attempts_of(straight)
    if not (done and done[-1].get("outcome") == "finished" and done[-1].get("highest_step") == args.steps):
        print("uninterrupted run ...", flush=True)
        shutil.rmtree(straight, ignore_errors=True)
        run(
            [
                *multiprocess(args),
                "train",
                str(recipe),
                f"run.dir={straight}",
                f"checkpoint.local_dir={work / 'local-straight'}",
            ],
            timeout=1800,
        )
    rehearsal_dir = work / "rehearsal"
    shutil.rmtree(rehearsal_dir, ignore_errors=True)
    shutil.rmtree(local_dir, ignore_errors=True)
    (work / "rehearsal.log").unlink(missing_ok=True)
    print("under the fault schedule ...", flush=True)
    rehearsal = Rehearsal(args, work, recipe, slow, local_dir)
    wall = rehearsal.go()
    bitwise, same_losses = compare(straight, rehearsal_dir, [str(recipe)], args.steps)
    costs = lost_per_fault(rehearsal_dir, rehearsal.faults)
    measured, baseline = read_goodput(rehearsal_dir), read_goodput(straight)
    projection = projected(args, recipe, rehearsal_dir, rehearsal.faults, costs, work / "rehearsal.log")

    print(
        f"\n{args.preset} recipe (model shrunk), {args.processes} processes x {args.devices} devices, {args.steps} "
        f"steps, {len(rehearsal.faults)} faults in {wall:.0f}s "
        f"({3600 * len(rehearsal.faults) / measured['wall_s']:.0f}"
        f"/hour realised), {os.cpu_count()} cores"
    )
    print(f"uninterrupted: {format_goodput(baseline)}")
    print(f"rehearsal:     {format_goodput(measured)}")
    by_kind: dict[str, list[dict]] = {}
    for cost in costs:
        by_kind.setdefault(cost["kind"], []).append(cost)
    print(f"{'kind':<20}{'n':>3}{'lost s/fault':>14}{'gap':>8}{'restart':>9}{'restore':>9}{'redone':>8}  served by")
    per_kind = {}
    for kind, entries in by_kind.items():
        mean = {
            k: statistics.mean(e[k] for e in entries) for k in ("total_s", "gap_s", "restart_s", "restore_s", "lost_s")
        }
        per_kind[kind] = {
            "count": len(entries),
            **mean,
            "redone_steps": statistics.mean(e["redone_steps"] for e in entries),
            "restored_from": sorted({e["restored_from"] for e in entries}),
        }
        print(
            f"{kind:<20}{len(entries):>3}{mean['total_s']:>14.1f}{mean['gap_s']:>8.1f}{mean['restart_s']:>9.1f}"
            f"{mean['restore_s']:>9.2f}{per_kind[kind]['redone_steps']:>8.1f}  "
            f"{', '.join(per_kind[kind]['restored_from'])}"
        )
    print(
        f"projected (llama-jax goodput fed these costs, rate and mix; durable every {projection['durable_every']}, "
        f"local every {projection['local_every']}): {100 * projection['goodput']:.1f}% vs measured "
        f"{100 * measured['goodput']:.1f}%: "
        + ", ".join(f"{k} {100 * v:.1f}%" for k, v in projection["breakdown"].items())
    )
    print(f"final params bitwise equal: {bitwise}; identical loss at every step: {same_losses}")
    result = {
        "preset": args.preset,
        "processes": args.processes,
        "devices": args.devices,
        "seed": args.seed,
        "steps": args.steps,
        "failures_per_hour": args.failures_per_hour,
        "failures_per_hour_realised": 3600 * len(rehearsal.faults) / measured["wall_s"],
        "goodput_measured": measured["goodput"],
        "goodput_projected": projection["goodput"],
        "params_bitwise_equal": bitwise,
        "same_losses": same_losses,
        "wall_s": wall,
        "breakdown_measured": {b: measured[b] / measured["wall_s"] for b in BUCKETS},
        "breakdown_projected": projection["breakdown"],
        "lost_per_kind": per_kind,
        "faults": [{k: v for k, v in f.items() if k != "at"} for f in rehearsal.faults],
        "goodput_uninterrupted": baseline["goodput"],
        "host_replacements": rehearsal.replacements,
        "projection_inputs": projection["inputs"],
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "goodput_measured",
                    "goodput_projected",
                    "params_bitwise_equal",
                    "failures_per_hour_realised",
                    "processes",
                    "seed",
                )
            }
        )
    )
    sys.exit(0 if bitwise else 1)


if __name__ == "__main__":
    main()
