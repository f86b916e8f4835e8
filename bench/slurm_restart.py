"""A restart under a real Slurm, part by part, for each first backoff of slurm.sbatch's supervisor side by side:
the job step on 2 emulated nodes (launch/slurm_emulated.sh, one process of one CPU device each), the task on the
second node SIGKILLed once step 8 is saved, the supervisor's restart inside the allocation, and the restart's
parts from the run's goodput.json (`llama-jax goodput --from`): detection (the failed attempt's last sign of life
until the new processes started: the step's teardown, the backoff, slurm_step.sh and srun), then each process's
own start.

    .venv/bin/python bench/slurm_restart.py [--backoff 30 10] [--work DIR] [--json out.json]

--backoff: seconds before the supervisor's first restart (LLAMA_JAX_RESTART_BACKOFF), one job each; "default"
runs slurm.sbatch as it ships. Needs root and Debian's slurm-wlm (slurm_emulated.sh installs it where it may;
exit 3 where it cannot). The tiny preset, 16 steps, a durable checkpoint every 4; process 0 sleeps 0.3 s before
each batch so the kill lands mid-run. The emulated cluster's KillWait is 5 s (Slurm's default: 30).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EMULATED = ROOT / "launch" / "slurm_emulated.sh"
KEYS = ["train.steps=16", "train.batch_size=4", "train.seq_len=64", "train.log_every=1", "checkpoint.every_steps=4"]
SLOW = ["inject.process=0", "inject.step_delay_s=0.3"]


def cluster_environment(work: Path) -> dict:
    """What the commands need to reach the emulated cluster and run llama-jax from this checkout on CPUs."""
    return {
        **os.environ,
        "SLURM_CONF": str(work / "slurm" / "slurm.conf"),
        "LLAMA_JAX_HOME": str(ROOT),
        "LLAMA_JAX": str(Path(sys.executable).parent / "llama-jax"),
        "LLAMA_JAX_GPU_FLAGS": "off",
        "LLAMA_JAX_LOCAL_DIR": str(work / "local"),
        "LLAMA_JAX_PREFLIGHT": "false",  # two processes on two shared cores time each other's matmuls
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "",
    }


def slurm(env: dict, *args: str) -> str:
    return subprocess.run(list(args), env=env, capture_output=True, text=True, check=True, timeout=60).stdout


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"slurm_restart: timed out waiting for {what}")
        time.sleep(0.2)


def task_pid(env: dict, job_id: str, node: str) -> int | None:
    """The trainer the job's first step runs on `node` (Slurm's own list of the step's processes there)."""
    lines = slurm(env, "scontrol", "listpids", f"{job_id}.0", node).splitlines()[1:]
    for pid in (int(line.split()[0]) for line in lines if line.split()):
        try:
            if b"train" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None


def one_restart(env: dict, work: Path, backoff: str) -> dict[str, float]:
    """One job whose second task is killed after step 8's checkpoint: its restart's parts (seconds)."""
    from llama_jax.planning.goodput_projection import start_parts

    run_dir = work / f"backoff-{backoff}"
    if backoff != "default":
        env = {**env, "LLAMA_JAX_RESTART_BACKOFF": backoff}
    submit = [
        "sbatch",
        "--parsable",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--gpus-per-node=0",
        f"--output={run_dir}.out",
    ]
    keys = [*KEYS, *SLOW, f"run.dir={run_dir}", f"run.compilation_cache={work / 'compilation-cache'}"]
    job_id = slurm(env, *submit, str(ROOT / "launch" / "slurm.sbatch"), "tiny", *keys).split(";")[0].strip()
    wait_for(lambda: (run_dir / "checkpoints" / "8" / "meta").is_dir(), 300, f"step 8 of job {job_id}")
    pid = task_pid(env, job_id, "n2")
    if pid is None:
        raise SystemExit(f"slurm_restart: no trainer of job {job_id} on n2 ({run_dir}.out)")
    os.kill(pid, 9)
    finished = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
    state = lambda: slurm(env, "scontrol", "show", "job", job_id, "-o").partition("JobState=")[2].split()[0]  # noqa: E731
    wait_for(lambda: state() in finished, 600, f"job {job_id} to end ({run_dir}.out)")
    if (ended := state()) != "COMPLETED":
        raise SystemExit(f"slurm_restart: job {job_id} ended {ended} ({run_dir}.out)")
    return start_parts(run_dir)["seconds"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backoff", nargs="+", default=["30", "10"], help="first backoffs, s (or default)")
    parser.add_argument("--work", type=Path, help="state and runs (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="write {backoff: {part: seconds}} here")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="slurm-restart-"))
    work.mkdir(parents=True, exist_ok=True)
    up = subprocess.run(["bash", str(EMULATED), "up", str(work / "slurm"), "2"], capture_output=True, text=True)
    if up.returncode:
        print(f"slurm_restart: {up.stderr.strip()}", file=sys.stderr)
        return up.returncode
    env = cluster_environment(work)
    try:
        results = {backoff: one_restart(env, work, backoff) for backoff in args.backoff}
    finally:
        subprocess.run(["bash", str(EMULATED), "down", str(work / "slurm")], capture_output=True, timeout=120)
    parts = list(dict.fromkeys(part for result in results.values() for part in result))
    print(f"restart after a killed task, slurm.sbatch on 2 emulated nodes (seconds; {work})")
    print(f"{'part':<18}" + "".join(f"{'backoff ' + b:>14}" for b in results))
    for part in [*parts, "total"]:
        row = [sum(r.values()) if part == "total" else r.get(part, 0.0) for r in results.values()]
        print(f"{part:<18}" + "".join(f"{value:>14.2f}" for value in row))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
