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


def process_environment(base: dict, index: int, processes: int, devices: int, port: int) -> dict:
    flags = " ".join(f for f in (base.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={devices}") if f)
    return {**base, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": str(processes), "JAX_PROCESS_ID": str(index),
            # llama_jax.errors.LAUNCHED_BY: a run that saves no checkpoint periodically warns
            "LLAMA_JAX_LAUNCHED_BY": base.get("LLAMA_JAX_LAUNCHED_BY", "launch/multiprocess.py")}


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
    parser.add_argument("--grace", type=float, default=90.0,
                        help="after a process fails, seconds the others get to stop on their own before SIGKILL")
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
    full = [*llama_jax_command(), *command]
    environments = [process_environment(dict(os.environ), i, args.processes, args.devices, port)
                    for i in range(args.processes)]
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
        return supervise_children(children, args.grace, stop)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def supervise_children(children: list[subprocess.Popen], grace: float, stop: list[int]) -> int:
    """Wait for every child; after the first failure (or a stop signal), kill what outlives the grace."""
    first_failure: int | None = None
    deadline: float | None = None
    forwarded = False
    started = time.monotonic()
    ended: set[int] = set()
    while True:
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
