"""How long `jax.distributed.initialize` takes against the number of processes that join: the part of a restart
that grows with the job (llama-jax goodput's restart model reads the fit this prints).

    .venv/bin/python bench/distributed_init.py [--processes 2 4 8 16 32 64] [--repeats 3] [--json out.json]

For each count P: P processes on this machine (one CPU device each, the coordinator on 127.0.0.1) import jax and
wait at a gate until every one of them has; process 0 then starts the coordination service, and once it listens
the others call jax.distributed.initialize at once. So the time is the joining's (connect, register, the barrier
at the end of initialize), not the imports', nor the retry about a second later of a client that finds the
service not yet up (a race a restart may meet once, whatever its size). The time of a count is its slowest
client's (the job waits for it), the median over --repeats. Prints one row per count and the least-squares line
seconds = a + b x P through them.

On a 2-core machine P processes share the cores, so b holds CPU contention a cluster's hosts do not have: the
line overstates a cluster's per-process cost; that is the side it errs on.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    """launch/multiprocess.py's free_port, its module loaded by path under a name of its own: imported as
    `multiprocess` it would stand in for the PyPI package of that name (which `datasets` imports) in this
    process, as test_goodput_projection runs this script in pytest's."""
    path = Path(__file__).resolve().parents[1] / "launch" / "multiprocess.py"
    spec = importlib.util.spec_from_file_location("llama_jax_launcher", path)
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    return launcher.free_port()


# One process: import jax, say so, wait for its gate file, initialize, print the seconds initialize took.
WORKER = """
import os, sys, time
import jax
gate, ready = sys.argv[1], sys.argv[2]
open(ready, "w").close()
while not os.path.exists(gate):
    time.sleep(0.005)
start = time.perf_counter()
jax.distributed.initialize(coordinator_address=sys.argv[3], num_processes=int(sys.argv[4]),
                           process_id=int(sys.argv[5]), initialization_timeout=300)
print(time.perf_counter() - start, flush=True)
jax.distributed.shutdown()
"""


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def one_count(processes: int) -> float:
    """The slowest of processes 1..P-1's initialize, in seconds, for one job of `processes` processes, the
    coordinator (process 0) already listening: a client that finds it not yet up retries about a second later,
    which would time the retry instead of the joining."""
    port = _free_port()
    environment = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    with tempfile.TemporaryDirectory() as work:
        gates = [Path(work) / "coordinator", Path(work) / "clients"]
        ready = [Path(work) / f"ready-{i}" for i in range(processes)]
        command = [sys.executable, "-c", WORKER]
        workers = [
            subprocess.Popen(
                [*command, str(gates[min(i, 1)]), str(ready[i]), f"127.0.0.1:{port}", str(processes), str(i)],
                env=environment,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(processes)
        ]
        try:
            wait_for(lambda: all(r.exists() for r in ready), workers, f"{processes} processes to import jax")
            gates[0].touch()
            wait_for(lambda: listening(port), workers, "the coordinator to listen")
            gates[1].touch()
            seconds = []
            for w in workers:
                out, err = w.communicate(timeout=600)
                if w.returncode != 0:
                    raise SystemExit(f"a process of {processes} failed (exit {w.returncode}): {err[-2000:]}")
                seconds.append(float(out.strip().splitlines()[-1]))
        finally:
            for w in workers:
                w.kill()
    return max(seconds[1:])


def wait_for(condition, workers: list[subprocess.Popen], what: str) -> None:
    deadline = time.monotonic() + 600
    while not condition():
        if time.monotonic() > deadline or any(w.poll() not in (None, 0) for w in workers):
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the rows and the line here")
    args = parser.parse_args()
    import jax

    print(f"jax.distributed.initialize on {os.cpu_count()} cores, jax {jax.__version__}, coordinator on 127.0.0.1")
    points = {}
    for count in args.processes:
        runs = [one_count(count) for _ in range(args.repeats)]
        points[count] = statistics.median(runs)
        each = ", ".join(f"{r:.3f}" for r in runs)
        print(f"  {count:>4} processes: {points[count]:.3f} s (median of {args.repeats}: {each})")
    b, a = statistics.linear_regression(list(points), list(points.values()))  # least squares
    print(f"fit: seconds = {a:.4f} + {b:.5f} x processes")
    if args.json:
        Path(args.json).write_text(json.dumps({"seconds": points, "a": a, "b": b, "jax": jax.__version__}, indent=1))


if __name__ == "__main__":
    main()
