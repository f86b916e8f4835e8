"""A restart under a real Slurm, part by part, for each first backoff of slurm.sbatch's supervisor side by side:
the job step on 2 emulated nodes (launch/slurm_emulated.sh, one process of one CPU device each), the task on the
second node SIGKILLed once step 8 is saved, the supervisor's restart inside the allocation, and the restart's
parts from the run's goodput.json (`llama-jax goodput --from`): detection (the failed attempt's last sign of life
until the new processes started: the step's teardown, the backoff, slurm_step.sh and srun), then each process's
own start. --first-node adds the case no supervisor survives: 3 nodes, one of them a spare (--no-kill, slurm.sbatch
--spares 1), and the first node (the batch script's, the supervisor's and process 0's) marked DOWN with all of the
job's processes on it SIGKILLed; the restart is then the successor job's (slurm.sbatch submits it at its start),
its detection the failure until the successor's processes started (the failed job ended, the successor scheduled,
its batch script, srun).

    .venv/bin/python bench/slurm_restart.py [--backoff 30 10] [--first-node] [--work DIR] [--json out.json]

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
    """The trainer the job runs on `node` (Slurm's own list of the job's processes there): the one told its place in
    the run (JAX_PROCESS_ID), not the supervisor, slurm_step.sh or srun, whose arguments say `train` too."""
    lines = slurm(env, "scontrol", "listpids", job_id, node).splitlines()[1:]
    for pid in (int(line.split()[0]) for line in lines if line.split()):
        try:
            told = b"JAX_PROCESS_ID=" in Path(f"/proc/{pid}/environ").read_bytes()
            if told and b"train" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None


def parent_and_below(pid: int) -> list[int]:
    """The parent of `pid` (the slurmstepd that started it) and every process under that parent."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    found, todo = [], [next(p for p, kids in children.items() if pid in kids)]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def batch_script(job_id: str) -> int:
    """The job's batch shell (slurmd runs it as <spool>/job<ID>/slurm_script)."""
    for entry in Path("/proc").iterdir():
        try:
            if f"job{int(job_id):05d}/slurm_script".encode() in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except (OSError, ValueError):
            continue
    raise SystemExit(f"slurm_restart: no batch script of job {job_id} is running")


def job_state(env: dict, job_id: str) -> str:
    return slurm(env, "scontrol", "show", "job", job_id, "-o").partition("JobState=")[2].split()[0]


FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def first_node_restart(env: dict, work: Path) -> dict[str, float]:
    """One job on 3 nodes (one a spare) whose first node dies after step 8's checkpoint: the successor job's
    restart, part by part (seconds)."""
    from llama_jax.planning.goodput_projection import start_parts

    run_dir = work / "first-node"
    submit = ["sbatch", "--parsable", "--nodes=3", "--no-kill", "--ntasks-per-node=1", "--gpus-per-node=0"]
    keys = [*KEYS, *SLOW, f"run.dir={run_dir}", f"run.compilation_cache={work / 'compilation-cache'}"]
    script = [str(ROOT / "launch" / "slurm.sbatch"), "--spares", "1", "tiny", *keys]
    job_id = slurm(env, *submit, f"--output={run_dir}.out", *script).split(";")[0].strip()
    wait_for(lambda: (run_dir / "checkpoints" / "8" / "meta").is_dir(), 300, f"step 8 of job {job_id}")
    log = Path(f"{run_dir}.out")
    successor = log.read_text().split("slurm.sbatch: job ", 1)[1].split()[0]
    trainer = task_pid(env, job_id, "n1")
    if trainer is None:
        raise SystemExit(f"slurm_restart: no trainer of job {job_id} on n1 ({log})")
    # n1 dies: its slurmd, the batch script's and the task's slurmstepd and all under them; then Slurm hears of it.
    slurmd = int((work / "slurm" / "slurmd-n1.pid").read_text())
    for pid in [slurmd, *parent_and_below(batch_script(job_id)), *parent_and_below(trainer)]:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    slurm(env, "scontrol", "update", "NodeName=n1", "State=DOWN", "Reason=slurm_restart")
    try:
        wait_for(lambda: job_state(env, successor) in FINISHED, 600, f"successor job {successor} ({log})")
    finally:  # n1 repaired
        subprocess.run(["slurmd", "-f", env["SLURM_CONF"], "-N", "n1"], env=env, timeout=60)
        subprocess.run(["scontrol", "update", "NodeName=n1", "State=RESUME"], env=env, capture_output=True, timeout=60)
    if (ended := job_state(env, successor)) != "COMPLETED":
        raise SystemExit(f"slurm_restart: successor job {successor} ended {ended} ({log})")
    return start_parts(run_dir)["seconds"]


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
    wait_for(lambda: job_state(env, job_id) in FINISHED, 600, f"job {job_id} to end ({run_dir}.out)")
    if (ended := job_state(env, job_id)) != "COMPLETED":
        raise SystemExit(f"slurm_restart: job {job_id} ended {ended} ({run_dir}.out)")
    return start_parts(run_dir)["seconds"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backoff", nargs="+", default=["30", "10"], help="first backoffs, s (or default)")
    parser.add_argument("--first-node", action="store_true", help="also the first node failing (3 nodes)")
    parser.add_argument("--work", type=Path, help="state and runs (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="write {case: {part: seconds}} here")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="slurm-restart-"))
    work.mkdir(parents=True, exist_ok=True)
    nodes = "3" if args.first_node else "2"
    up = subprocess.run(["bash", str(EMULATED), "up", str(work / "slurm"), nodes], capture_output=True, text=True)
    if up.returncode:
        print(f"slurm_restart: {up.stderr.strip()}", file=sys.stderr)
        return up.returncode
    env = cluster_environment(work)
    try:
        results = {f"backoff {backoff}": one_restart(env, work, backoff) for backoff in args.backoff}
        if args.first_node:
            results["first node"] = first_node_restart(env, work)
    finally:
        subprocess.run(["bash", str(EMULATED), "down", str(work / "slurm")], capture_output=True, timeout=120)
    parts = list(dict.fromkeys(part for result in results.values() for part in result))
    print(f"restart after a killed task, slurm.sbatch on {nodes} emulated nodes (seconds; {work})")
    print(f"{'part':<18}" + "".join(f"{case:>14}" for case in results))
    for part in [*parts, "total"]:
        row = [sum(r.values()) if part == "total" else r.get(part, 0.0) for r in results.values()]
        print(f"{part:<18}" + "".join(f"{value:>14.2f}" for value in row))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
