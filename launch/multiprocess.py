#!/usr/bin/env python3
"""Run a multi-process llama-jax job on this machine: N processes x D simulated CPU devices each, joined
by jax.distributed over 127.0.0.1 with CPU collectives -- a multi-host run on a laptop.

    launch/multiprocess.py [--processes N] [--devices D] [--port P] [--grace S] [--dry-run] [--] \\
        [train|plan|doctor] [PRESET|CONFIG] [key=value ...]

Every process runs the same llama-jax command with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID set, as launch/slurm.sbatch, launch/k8s.sh and launch/multihost.sh set them on a
cluster. Process 0 prints the log; the others print only warnings. SIGTERM/SIGINT are forwarded to
every process (they save a checkpoint and exit 75).

When a process fails, the others are given --grace seconds to notice on their own (a failed
collective, or JAX's heartbeat after run.heartbeat_timeout_s) and are then killed; the launcher
exits with the first failure's status (128 + signal number for a killed process), so
`llama-jax supervise -- launch/multiprocess.py ...` restarts all of them together.

Continuing on fewer hosts (--hosts FILE): every process is a simulated host, named by a line of FILE (the
hosts that are up now; delete a line to lose that host, add it back to return it). A start waits up to
--replacement-wait seconds for --processes hosts; if fewer are up it starts on the largest count that divides
--processes (4 -> 2 with 3 hosts up), passing run.full_processes, so the global batch stays the same with more
micro-batches per process. While it runs on fewer, it polls FILE: once enough hosts are back it sends SIGTERM
(every process saves the step it is at and exits 75) and exits 75, and `llama-jax supervise` starts it again
on all of them. The run resumes from the newest step any tier holds either way, the node-local tier's included
(laid out on the new process count; the loader resumes exactly on it). A start on all hosts records their order
in FILE.ring: on half of them it runs on every other host of that ring, which between them hold every process's
local shards (choose_hosts). On a cluster the same loop reads the scheduler's list of healthy nodes instead of
FILE (docs/fault-tolerance.md).
Standard library only: runs wherever Python 3.9+ does.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_jax_command() -> list[str]:
    """The repository's venv entry point, else `llama-jax` on PATH; LLAMA_JAX overrides (a command line)."""
    if os.environ.get("LLAMA_JAX"):
        return shlex.split(os.environ["LLAMA_JAX"])
    venv = HERE.parent / ".venv" / "bin" / "llama-jax"
    return [str(venv)] if venv.exists() else ["llama-jax"]


def hosts_up(path: Path) -> list[str]:
    """The simulated hosts listed in path (one name a line), in order; none if it cannot be read."""
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def usable(full: int, up: int) -> int:
    """The most processes, at most `up`, that divide `full`: each keeps a whole share of the global batch."""
    return max((n for n in range(1, min(full, up) + 1) if full % n == 0), default=0)


def ring_file(path: Path) -> Path:
    """Where the launcher keeps the order of the hosts it last started all --processes on: FILE.ring."""
    return path.with_name(path.name + ".ring")


def choose_hosts(up: list[str], full: int, ring: list[str]) -> list[str]:
    """The hosts to run on, in process order: all `full` when they are up; else `usable` of them, every other host
    of `ring` (the order the job last ran on all of them) when that is possible. Process i's partner copy of its
    local checkpoint is on the host after it in that ring (checkpoint.local_replicas=1, one process a host), so
    every other host holds, between them, every process's shards: the run on half the hosts resumes from the
    newest local step instead of an older durable one. Otherwise (more than half gone, or two neighbours) the
    first usable hosts, and the run resumes from what they hold, else from checkpoints/."""
    count = usable(full, len(up))
    if count == full:
        return up[:full]
    if count * 2 == full and sorted(ring) == sorted(set(ring)) and len(ring) == full:
        for first in (0, 1):
            if all(host in up for host in ring[first::2]):
                return ring[first::2]
    return up[:count]


def wait_for_hosts(path: Path, full: int, wait: float) -> list[str]:
    """The hosts to start on: all `full` when they are up within `wait` seconds, else the usable part
    (choose_hosts); a start on all of them records their order (ring_file)."""
    deadline = time.monotonic() + wait
    while len(up := hosts_up(path)) < full and time.monotonic() < deadline:
        time.sleep(0.2)
    chosen = choose_hosts(up, full, hosts_up(ring_file(path)))
    if len(up) < full:
        log(
            f"{len(up)} of {full} hosts up after waiting {wait:g}s for replacements (--replacement-wait): "
            f"continuing on {len(chosen)} ({', '.join(chosen)})"
        )
    elif chosen:
        try:
            ring_file(path).write_text("".join(f"{host}\n" for host in chosen))
        except OSError as err:
            log(
                f"warning: cannot record the hosts' order in {ring_file(path)} ({err}); on fewer hosts the "
                "first ones are chosen"
            )
    return chosen


def process_environment(base: dict, index: int, processes: int, devices: int, port: int) -> dict:
    flags = " ".join(f for f in (base.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={devices}") if f)
    return {
        **base,
        "XLA_FLAGS": flags,
        "JAX_PLATFORMS": "cpu",
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_NUM_PROCESSES": str(processes),
        "JAX_PROCESS_ID": str(index),
        # llama_jax.errors.LAUNCHED_BY: a run that saves no checkpoint periodically warns
        "LLAMA_JAX_LAUNCHED_BY": base.get("LLAMA_JAX_LAUNCHED_BY", "launch/multiprocess.py"),
    }


def status_of(returncode: int) -> int:
    """A shell's view of a child's end: its exit status, or 128 + the signal that killed it."""
    return 128 - returncode if returncode < 0 else returncode


def log(message: str) -> None:
    print(f"multiprocess: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices per process")
    parser.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument(
        "--grace",
        type=float,
        default=90.0,
        help="after a process fails, seconds the others get to stop on their own before SIGKILL",
    )
    parser.add_argument(
        "--hosts",
        type=Path,
        help="file listing the simulated hosts that are up, one a line: "
        "continue on fewer when some are gone, grow back when they return",
    )
    parser.add_argument(
        "--replacement-wait",
        type=float,
        default=60.0,
        help="with --hosts: seconds a start waits for missing hosts before continuing on fewer",
    )
    parser.add_argument("--dry-run", action="store_true", help="print each process's command and exit")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.processes < 1 or args.devices < 1:
        print("multiprocess: error: --processes and --devices must be positive", file=sys.stderr)
        return 2
    if not command or command[0] not in ("train", "plan", "doctor"):
        command = ["train", *command]
    port = args.port or free_port()
    hosts: list[str] = []
    if args.hosts is not None:
        hosts = wait_for_hosts(args.hosts, args.processes, args.replacement_wait)
        if not hosts:
            log(f"no host is up in {args.hosts}")
            return 1
        command = [*command, f"run.full_processes={args.processes}"]
    count = len(hosts) or args.processes
    full = [*llama_jax_command(), *command]
    environments = [process_environment(dict(os.environ), i, count, args.devices, port) for i in range(count)]
    for env, host in zip(environments, hosts):
        env["LLAMA_JAX_NODE_NAME"] = host  # processes.node_name(): this process is that host
    if args.dry_run:
        keys = ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
        for env in environments:
            print(" ".join(f"{k}={shlex.quote(env[k])}" for k in keys), shlex.join(full))
        return 0

    children: list[subprocess.Popen] = []
    stop: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: stop.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i, env in enumerate(environments):
            children.append(subprocess.Popen(full, env=env))
            log(f"process {i} started (pid {children[-1].pid})")
        grow = (lambda: len(hosts_up(args.hosts)) >= args.processes) if count < args.processes else None
        return supervise_children(children, args.grace, stop, grow)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def supervise_children(children: list[subprocess.Popen], grace: float, stop: list[int], grow=None) -> int:
    """Wait for every child; after the first failure (or a stop signal), kill what outlives the grace.
    grow(): whether enough hosts are back to run on all of them: then stop (SIGTERM: they save) and exit 75."""
    first_failure: int | None = None
    deadline: float | None = None
    forwarded = False
    started = time.monotonic()
    ended: set[int] = set()
    polled = time.monotonic()
    while True:
        if grow is not None and not stop and time.monotonic() - polled > 1.0:
            polled = time.monotonic()
            if grow():
                log("the missing hosts are back: stopping (every process saves) to start again on all of them")
                stop.append(signal.SIGTERM)
        if stop and not forwarded:
            for child in children:
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
            forwarded, deadline = True, time.monotonic() + grace
        for i, child in enumerate(children):
            if i in ended or child.poll() is None:
                continue
            ended.add(i)
            status = status_of(child.returncode)
            log(f"process {i} exited with status {status} after {time.monotonic() - started:.1f}s")
            if status != 0 and first_failure is None:
                first_failure, deadline = status, time.monotonic() + grace
        if len(ended) == len(children):
            return first_failure or 0
        if deadline is not None and time.monotonic() > deadline:
            for i, child in enumerate(children):
                if child.poll() is None:
                    log(f"process {i} still running {grace:g}s after the first failure or signal: killing it")
                    child.kill()
            deadline = None
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
