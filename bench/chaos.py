"""Chaos drill: train a preset under `llama-jax supervise` while SIGKILLs hit the trainer at random
times, next to the same run left alone, all in this one invocation; with --local-every N, the drill runs
twice with the same kill schedule: durable checkpoints only, then with the node-local tier as well.

    .venv/bin/python bench/chaos.py [--preset tiny] [--steps 300] [--kills 10] [--seed 0] [--local-every N]
        [--host-loss-every K] [--processes 1] [--log-every 1] [--json out.json] [key=value ...]

Prints, for both runs, the wall time and the goodput with its breakdown (compile, checkpoint save and
restore, data wait, lost = steps computed twice, restart = process start-up and supervisor backoff) and
the steps redone per failure, and checks that the interrupted run ends with parameters bitwise equal to
the uninterrupted one and the same loss at every step. Both runs share one data cache and one JAX
compilation cache, warmed first, so neither pays a cold compilation the other does not.

Kills: after each (re)start of the trainer, wait a uniformly random time in [--min-gap, --max-gap]
seconds, then SIGKILL the trainer process (not the supervisor), until --kills have been sent. A kill
can land anywhere: during start-up, compilation, restore, a step, an asynchronous save or the eval.
Host losses (--host-loss-every K): every K-th kill also deletes the trainer's node-local checkpoint
directory, as losing the whole host would; the restart must then be served by another tier.

With --processes N > 1 every run is a multi-process job on this machine (launch/multiprocess.py: N
processes of one CPU device each, as N hosts), the supervisor restarts all of them together, and the
kills hit the processes' trainers in turn; a host loss deletes the victim's local directory, so the
partner's copy (checkpoint.local_replicas=1) must serve it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LLAMA_JAX = [sys.executable, "-m", "llama_jax"]
MULTIPROCESS = Path(__file__).resolve().parents[1] / "launch" / "multiprocess.py"


def environment() -> dict:
    # One CPU device per trainer, as a user's laptop run; the parent's simulated devices are not inherited.
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", LLAMA_JAX=shlex.join(LLAMA_JAX))


def trainer_command(processes: int) -> list[str]:
    """`llama-jax` itself, or the local multi-process launcher running it as `processes` one-device hosts."""
    if processes == 1:
        return LLAMA_JAX
    return [sys.executable, str(MULTIPROCESS), "--processes", str(processes), "--devices", "1", "--grace", "2", "--"]


def children_of(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def trainer_pid(supervisor: subprocess.Popen, process: int, processes: int) -> int | None:
    """The pid of the trainer of `process`, read from /proc: the supervisor's child, or with several
    processes the launcher's child with that JAX_PROCESS_ID; None between attempts."""
    children = children_of(supervisor.pid)
    if processes == 1 or not children:
        return children[0] if children else None
    for pid in children_of(children[0]):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"JAX_PROCESS_ID={process}".encode() in environ:
            return pid
    return None


def chaos(supervisor: subprocess.Popen, args, rng: random.Random, sent: list[dict], local_dirs: list[Path]) -> None:
    """SIGKILL one new trainer process after a random delay, args.kills times in all, the processes in
    turn; every args.host_loss_every-th kill also deletes the victim's local directory (local_dirs[process])
    once it is gone (a lost host takes its local storage along)."""
    killed: set[int] = set()
    while len(sent) < args.kills and supervisor.poll() is None:
        victim = len(sent) % args.processes
        pid = trainer_pid(supervisor, victim, args.processes)
        if pid is None or pid in killed:
            time.sleep(0.02)
            continue
        delay = rng.uniform(args.min_gap, args.max_gap)
        started = time.monotonic()
        while (
            time.monotonic() - started < delay
            and supervisor.poll() is None
            and trainer_pid(supervisor, victim, args.processes) == pid
        ):
            time.sleep(0.02)
        if trainer_pid(supervisor, victim, args.processes) != pid:  # it ended (finished, or a peer failed) first
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed.add(pid)
        host_lost = bool(args.host_loss_every) and len(sent) % args.host_loss_every == args.host_loss_every - 1
        if host_lost:
            while Path(f"/proc/{pid}").exists():
                time.sleep(0.01)
            shutil.rmtree(local_dirs[victim], ignore_errors=True)
        sent.append({"process": victim, "pid": pid, "after_s": round(delay, 2), "host_lost": host_lost})


def final_state(run_dir: Path, config_args: list[str], step: int):
    """The train state saved at `step`, restored on one CPU device, as numpy arrays."""
    import jax
    import numpy as np

    from llama_jax.config import load_config
    from llama_jax.training.run import load_checkpoint

    config = load_config(config_args[0], [*config_args[1:], f"run.dir={run_dir}", "mesh.fsdp=1"])
    state, _ = load_checkpoint(config, step, devices=jax.devices()[:1])
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of the newest record of that step (a resumed run re-logs the steps it recomputes)."""
    from llama_jax.training.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def supervised(train: list[str], run_dir: Path, args, local_dirs: list[Path]) -> tuple[float, list[dict]]:
    """The run under the supervisor, killed on the drill's schedule (the seed fixes the delays)."""
    supervise = [
        *LLAMA_JAX,
        "supervise",
        "--backoff",
        str(args.backoff),
        "--max-backoff",
        str(4 * args.backoff),
        "--max-restarts",
        str(args.kills + 5),
        "--",
    ]
    sent: list[dict] = []
    start = time.perf_counter()
    supervisor = subprocess.Popen(
        [*supervise, *train, f"run.dir={run_dir}"],
        env=environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    killer = threading.Thread(
        target=chaos, args=(supervisor, args, random.Random(args.seed), sent, local_dirs), daemon=True
    )
    killer.start()
    _, supervisor_log = supervisor.communicate()
    wall = time.perf_counter() - start
    killer.join(timeout=1)
    if supervisor.returncode != 0:
        sys.exit(f"the supervised run failed (exit {supervisor.returncode}):\n{supervisor_log}")
    return wall, sent


def compare(straight_dir: Path, chaos_dir: Path, config_args: list[str], steps: int) -> tuple[bool, bool]:
    """(final params bitwise equal, the same loss at every step the straight run logged)."""
    import numpy as np

    expected, got = final_state(straight_dir, config_args, steps), final_state(chaos_dir, config_args, steps)
    bitwise = len(expected) == len(got) and all(np.array_equal(a, b) for a, b in zip(expected, got))
    # The interrupted run also logs the first step of every attempt: compare the steps both logged,
    # and it must have logged every step the straight run did.
    straight_losses, chaos_losses = losses(straight_dir), losses(chaos_dir)
    return bitwise, all(chaos_losses.get(step) == loss for step, loss in straight_losses.items())


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--every-steps", type=int, default=20, help="checkpoint interval of both runs")
    parser.add_argument("--min-gap", type=float, default=3.0, help="shortest time from a (re)start to its kill")
    parser.add_argument("--max-gap", type=float, default=25.0, help="longest time from a (re)start to its kill")
    parser.add_argument("--backoff", type=float, default=1.0, help="the supervisor's first restart delay")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill times")
    parser.add_argument("--work", help="keep the run directories here (default: a temporary directory)")
    parser.add_argument(
        "--local-every",
        type=int,
        default=0,
        help="also run the drill with the node-local tier saving every N steps (0: durable only)",
    )
    parser.add_argument(
        "--host-loss-every",
        type=int,
        default=0,
        help="every K-th kill also deletes the trainer's local checkpoint directory (0: never)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="run every run as this many one-device processes (hosts) on this machine",
    )
    parser.add_argument(
        "--log-every",
        type=int,
        default=1,
        help="train.log_every of every run: goodput.json is flushed at each logged step, and a killed "
        "attempt's work after its last flush is charged to restart, not lost (1: lost is exact "
        "to the step)",
    )
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for both runs")
    args = parser.parse_args(argv)
    if args.processes < 1 or args.kills < 0 or args.host_loss_every < 0 or args.log_every < 1:
        parser.error("--processes and --log-every must be positive, --kills and --host-loss-every not negative")
    return args


def main() -> None:
    args = arguments()

    from llama_jax.resilience.goodput import BUCKETS, format_goodput, read_goodput

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        config_args = [
            args.preset,
            f"train.steps={args.steps}",
            f"checkpoint.every_steps={args.every_steps}",
            f"checkpoint.keep={args.steps}",
            f"data.cache_dir={work / 'cache'}",
            f"run.compilation_cache={work / 'jax_cache'}",
            "run.tensorboard=false",
            f"train.log_every={args.log_every}",
            *args.overrides,
        ]
        train = [*trainer_command(args.processes), "train", *config_args]

        print("warming the data and compilation caches ...", flush=True)
        warm = subprocess.run(
            [*train, f"run.dir={work / 'warm'}", "train.steps=2"], env=environment(), capture_output=True, text=True
        )
        if warm.returncode != 0:
            sys.exit(f"warm-up failed:\n{warm.stderr}")

        print(f"uninterrupted: {args.steps} steps ...", flush=True)
        straight_dir = work / "straight"
        start = time.perf_counter()
        straight = subprocess.run(
            [*train, f"run.dir={straight_dir}"], env=environment(), capture_output=True, text=True
        )
        straight_wall = time.perf_counter() - start
        if straight.returncode != 0:
            sys.exit(f"the uninterrupted run failed:\n{straight.stderr}")

        from llama_jax.checkpoint.local_files import process_directory

        drills = {"durable only": []}
        if args.local_every:
            drills[f"+ local every {args.local_every}"] = [
                f"checkpoint.local_dir={work / 'local'}",
                f"checkpoint.local_every_steps={args.local_every}",
            ]
        runs = {"uninterrupted": (straight_wall, read_goodput(straight_dir), [])}
        bitwise, same_losses = True, True
        for name, tier in drills.items():
            chaos_dir = work / name.replace(" ", "-").replace("+", "with")
            print(f"under the supervisor with {args.kills} SIGKILLs, {name} ...", flush=True)
            local_dirs = [process_directory(str(work / "local"), chaos_dir, i) for i in range(args.processes)]
            wall, sent = supervised(train + tier, chaos_dir, args, local_dirs)
            equal, same = compare(straight_dir, chaos_dir, config_args, args.steps)
            bitwise, same_losses = bitwise and equal, same_losses and same
            runs[f"{args.kills} kills, {name}"] = (wall, read_goodput(chaos_dir), sent)

    print(
        f"\n{args.preset}, {args.steps} steps, checkpoint every {args.every_steps} steps, "
        f"{args.processes} process{'es' * (args.processes > 1)}, {os.cpu_count()} cores"
    )
    for name, (_, _, kills) in runs.items():
        if kills:
            described = ", ".join(
                f"{k['after_s']}"
                + (f" (process {k['process']})" if args.processes > 1 else "")
                + " (host lost)" * k["host_lost"]
                for k in kills
            )
            print(f"{name}: seconds from each start to its kill: {described}")
    columns = ["wall_s", "goodput", *BUCKETS, "attempts"]
    print(f"{'run':<30}" + "".join(f"{c:>19}" if c == "checkpoint_restore" else f"{c:>16}" for c in columns))
    results = {"preset": args.preset, "steps": args.steps, "bitwise_equal_params": bitwise, "same_losses": same_losses}
    for name, (wall, goodput, kills) in runs.items():
        row = {**goodput, "accounted_s": goodput["wall_s"], "wall_s": wall}
        cells = [
            f"{100 * row[c]:.1f}%" if c == "goodput" else (f"{row[c]}" if c == "attempts" else f"{row[c]:.1f}")
            for c in columns
        ]
        print(
            f"{name:<30}"
            + "".join(f"{v:>19}" if c == "checkpoint_restore" else f"{v:>16}" for c, v in zip(columns, cells))
        )
        row["kills"] = kills
        results[name] = row
        print(f"{'':<30}{format_goodput(goodput)}")
        if kills:
            # A kill during start-up leaves no attempt on record (its time is in the next one's restart):
            # the failures are the kills sent.
            failures = len(kills)
            per_failure = {k: goodput[k] / failures for k in ("lost", "restart", "checkpoint_restore")}
            row["per_failure_s"], row["redone_steps_per_failure"] = per_failure, goodput["redone_steps"] / failures
            print(
                f"{'':<30}per failure: lost {per_failure['lost']:.2f}s ({goodput['redone_steps'] / failures:.1f} "
                f"steps redone), restart {per_failure['restart']:.2f}s, restore "
                f"{per_failure['checkpoint_restore']:.2f}s, total {sum(per_failure.values()):.2f}s over "
                f"{failures} failures"
            )
            served = "; ".join(f"{n} x {source}" for source, n in goodput["restores"].items())
            print(f"{'':<30}restores served by: {served or 'none (every restart began from scratch)'}")
    print(f"final params bitwise equal: {bitwise}; identical loss at every step: {same_losses}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    sys.exit(0 if bitwise and same_losses else 1)


if __name__ == "__main__":
    main()
