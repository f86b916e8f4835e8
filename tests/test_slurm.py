"""launch/slurm.sbatch under a real Slurm: emulated nodes on this machine (launch/slurm_emulated.sh: one slurmctld,
a slurmd per node), one llama-jax process per node on CPU devices, run by sbatch as a user submits it. A run
finishes; a task SIGKILLed mid-run makes the script's supervisor start the job step again inside the allocation,
and it resumes to the uninterrupted run's losses bit for bit; SIGTERM to the batch script (what --signal=B:TERM and
a preemption send) saves, exits 75, requeues the job and the requeued job resumes to the same losses. A node down
with a spare: the spare takes its place; a node drained with none: the run continues on one node and grows back.
The first node dying (batch script, supervisor and process 0 with it): the watch on the second node ends the job,
and the successor job the script submitted at its start resumes the run on the other nodes to the same losses.

Skipped, naming why, where Slurm is not installed and cannot be (slurm_emulated.sh exit 3). slow and newest_leg: CI's
newest leg runs it (about two and a half minutes), as GPU clusters run Python >= 3.12 and the newest jax."""

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import COMPILE_FLAGS

from llama_jax.resilience.goodput import START_PARTS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "slurm_emulated.sh"
NODES = 3
pytestmark = [pytest.mark.slow, pytest.mark.newest_leg]  # CI's newest leg runs it: GPU clusters' Python and jax


@dataclass(frozen=True)
class Cluster:
    directory: Path
    env: dict

    def run(self, *args, check=True) -> str:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, check=check, timeout=60).stdout

    def job(self, job_id: str) -> dict:
        """scontrol's fields of the job (JobState, Restarts, ...)."""
        fields = self.run("scontrol", "show", "job", job_id, "-o").split()
        return dict(field.split("=", 1) for field in fields if "=" in field)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    directory = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(
        ["bash", str(SCRIPT), "up", str(directory), str(NODES)], capture_output=True, text=True, timeout=600
    )
    if up.returncode == 3:
        pytest.skip(up.stderr.strip())
    assert up.returncode == 0, up.stderr
    env = {
        **os.environ,
        "SLURM_CONF": str(directory / "slurm.conf"),
        "LLAMA_JAX_HOME": str(ROOT),
        "LLAMA_JAX": str(Path(os.sys.executable).parent / "llama-jax"),
        "LLAMA_JAX_GPU_FLAGS": "off",
        "LLAMA_JAX_RESTART_BACKOFF": "1",
        "LLAMA_JAX_GROW_POLL_S": "1",  # a run on fewer nodes looks for the others every second
        "LLAMA_JAX_GUARD_POLL_S": "1",  # the watch over the first node (slurm_guard.sh) looks every second
        "LLAMA_JAX_LOCAL_DIR": str(directory / "local"),
        # Two processes sharing two cores time each other's matmuls: the pre-flight check (tested on its own in
        # test_preflight.py) would name a loaded "node" now and then.
        "LLAMA_JAX_PREFLIGHT": "false",
    }
    env["XLA_FLAGS"] = COMPILE_FLAGS  # without the device count: one CPU device per process, as one GPU per task
    yield Cluster(directory, env)
    subprocess.run(["bash", str(SCRIPT), "down", str(directory)], capture_output=True, timeout=120)


def submit(cluster: Cluster, run_dir: Path, spares: int = 0, delay: float = 0.3) -> str:
    """slurm.sbatch on 2 nodes (+ `spares`), one process each: the tiny preset, 16 steps, a durable checkpoint every
    4. Process 0 sleeps `delay` s before each batch, so a test has time to act mid-run (it changes no number)."""
    args = [
        "tiny",
        "train.steps=16",
        "train.batch_size=4",
        "train.seq_len=64",
        "train.log_every=1",
        "checkpoint.every_steps=4",
        "inject.process=0",
        f"inject.step_delay_s={delay}",
        f"run.dir={run_dir}",
    ]
    keep = ["--no-kill"] if spares else []  # the allocation outlives a failed node: its spare takes its place
    out = cluster.run(
        "sbatch",
        "--parsable",
        f"--nodes={2 + spares}",
        "--ntasks-per-node=1",
        "--gpus-per-node=0",
        *keep,
        f"--output={run_dir}.out",
        str(ROOT / "launch" / "slurm.sbatch"),
        *(["--spares", str(spares)] if spares else []),
        *args,
    )
    return out.strip().split(";")[0]


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def finished(cluster: Cluster, job_id: str, run_dir: Path, timeout: float = 240) -> dict:
    done = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
    wait_for(lambda: cluster.job(job_id).get("JobState") in done, timeout, f"job {job_id}: {run_dir}.out")
    return cluster.job(job_id)


def losses(run_dir: Path) -> dict[int, float]:
    """Each step's training loss, the last one logged (a step redone after a restart is logged again)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def saved(run_dir: Path, step: int) -> bool:
    return (run_dir / "checkpoints" / str(step) / "meta").is_dir()


def task_pid(run_dir: Path, process: int) -> int | None:
    """The llama-jax process of the job step with JAX_PROCESS_ID=process training into run_dir."""
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if (
            f"run.dir={run_dir}".encode() in cmdline
            and b"train" in cmdline
            and f"JAX_PROCESS_ID={process}".encode() in environ
            and b"SLURM_JOB_ID" in b"".join(environ)
        ):
            return int(entry.name)
    return None


def batch_script_pid(job_id: str) -> int:
    """The batch shell of a job (slurmd runs the script as <spool>/job<ID>/slurm_script)."""
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if f"job{int(job_id):05d}/slurm_script".encode() in cmdline or f"job{job_id}/slurm_script".encode() in cmdline:
            return int(entry.name)
    raise AssertionError(f"no batch script of job {job_id} is running")


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "uninterrupted"
    job = finished(cluster, submit(cluster, run_dir, delay=0), run_dir)  # nothing to act on: no pause needed
    assert job["JobState"] == "COMPLETED", (run_dir.with_suffix(".out")).read_text()[-3000:]
    return losses(run_dir)


def test_a_run_under_slurm_sbatch_trains_one_process_per_node(uninterrupted):
    assert sorted(uninterrupted) == list(range(1, 17))
    assert uninterrupted[16] < uninterrupted[1]


def test_a_killed_task_restarts_the_step_inside_the_allocation_and_resumes_exactly(cluster, uninterrupted, tmp_path):
    run_dir = tmp_path / "killed"
    job_id = submit(cluster, run_dir)
    wait_for(lambda: saved(run_dir, 8), 180, "step 8's checkpoint")
    pid = task_pid(run_dir, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    job = finished(cluster, job_id, run_dir)
    log = Path(f"{run_dir}.out").read_text()
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "0", log[-3000:]  # the same allocation throughout
    assert "llama-jax supervise: start #2" in log and "resumed from" in log, log[-3000:]
    assert losses(run_dir) == uninterrupted
    # The restart inside the allocation, part by part (goodput.json, written by process 0): every process joined
    # the run again (distributed_init) and restored before its first step (no pre-flight here: the fixture's).
    restarted = json.loads((run_dir / "goodput.json").read_text())["attempts"][-1]["start"]
    assert list(restarted) == [p for p in START_PARTS if p != "preflight"], restarted
    assert restarted["distributed_init"] > 0 and restarted["restore"] > 0


def test_sigterm_to_the_batch_script_saves_requeues_and_the_job_resumes_exactly(cluster, uninterrupted, tmp_path):
    run_dir = tmp_path / "preempted"
    job_id = submit(cluster, run_dir)
    wait_for(lambda: saved(run_dir, 4) and max(losses(run_dir), default=0) >= 6, 180, "step 6")
    os.kill(batch_script_pid(job_id), signal.SIGTERM)  # what --signal=B:TERM@300 sends before the time limit
    # requeued, it starts again once its old credential expired (slurm_emulated.sh: 10 s; Slurm's default 120 s)
    wait_for(lambda: cluster.job(job_id).get("Restarts", "0") != "0", 120, f"job {job_id}'s requeue")
    job = finished(cluster, job_id, run_dir)
    log = Path(f"{run_dir}.out").read_text()
    assert job["JobState"] == "COMPLETED", log[-3000:]
    assert "slurm.sbatch: saved after SIGTERM; requeueing job" in log and "resumed from" in log, log[-3000:]
    assert losses(run_dir) == uninterrupted


def test_a_node_down_is_replaced_by_a_spare_inside_the_allocation_and_the_run_resumes_exactly(
    cluster, uninterrupted, tmp_path
):
    """sbatch --nodes 3 --no-kill, slurm.sbatch --spares 1: the step trains on n1 and n2; n2 goes DOWN (its
    process killed with it), and the restarted step runs on n1 and the spare n3, in the same job."""
    run_dir = tmp_path / "spare"
    job_id = submit(cluster, run_dir, spares=1)
    wait_for(lambda: saved(run_dir, 8), 180, "step 8's checkpoint")
    pid = task_pid(run_dir, 1)
    assert pid is not None
    try:
        cluster.run("scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=test_slurm")
        # A node's death takes its process with it; Slurm may already have ended it for the DOWN node.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        job = finished(cluster, job_id, run_dir)
    finally:
        cluster.run("scontrol", "update", "NodeName=n2", "State=RESUME", check=False)
    log = Path(f"{run_dir}.out").read_text()
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "0", log[-3000:]
    assert "slurm_step: on n1 n2; spare(s): n3" in log, log[-3000:]
    assert "llama-jax supervise: start #2" in log and "slurm_step: on n1 n3" in log, log[-3000:]
    assert "resumed from" in log, log[-3000:]
    assert losses(run_dir) == uninterrupted


def test_a_drained_node_without_a_spare_shrinks_the_run_and_it_grows_back_when_resumed(
    cluster, uninterrupted, tmp_path
):
    """sbatch --nodes 2, no spare: n2's task dies and n2 is drained (what a health check does to a node it
    distrusts). The restarted step continues on n1 alone with run.full_processes=2 (two micro-batches: the same
    global batch) and, once n2 is resumed, saves (exit 75) and runs on both again, in the same job. Every loss is
    the uninterrupted run's within 1e-5 relative (one process sums the gradient in another order), and bit for bit
    before the failure."""
    run_dir = tmp_path / "shrunk"
    log_file = Path(f"{run_dir}.out")
    job_id = submit(cluster, run_dir, delay=0.6)  # time to resume n2 while the run is on one node
    wait_for(lambda: saved(run_dir, 4), 180, "step 4's checkpoint")
    pid = task_pid(run_dir, 1)
    assert pid is not None
    try:
        cluster.run("scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=test_slurm")
        os.kill(pid, signal.SIGKILL)
        alone = "slurm_step: on n1\n"  # the restarted step, on n1 alone, has trained a step
        wait_for(lambda: "\nstep " in log_file.read_text().partition(alone)[2], 180, f"a step on n1 alone: {log_file}")
    finally:
        cluster.run("scontrol", "update", "NodeName=n2", "State=RESUME", check=False)
    job = finished(cluster, job_id, run_dir)
    log = log_file.read_text()
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "0", log[-3000:]
    assert "slurm_step: 1 healthy node(s) of the 2 needed and no spare left: continuing on 1" in log, log[-3000:]
    assert "slurm_step: on n1\n" in log and "run.full_processes=2" in log, log[-3000:]
    assert "slurm_step: 2 healthy nodes again (n1 n2): saving and restarting on all of them" in log, log[-3000:]
    assert log.count("slurm_step: on n1 n2") == 2, log[-3000:]  # the first start, and again after growing back
    got = losses(run_dir)
    assert sorted(got) == sorted(uninterrupted)
    assert all(got[step] == uninterrupted[step] for step in range(1, 5))
    assert all(abs(got[step] - loss) <= 1e-5 * abs(loss) for step, loss in uninterrupted.items()), got


def descendants(pid: int) -> list[int]:
    """pid and every process under it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_the_first_node_failing_is_taken_over_by_the_successor_job_and_the_run_resumes_exactly(
    cluster, uninterrupted, tmp_path
):
    """sbatch --nodes 3 --no-kill, slurm.sbatch --spares 1: the step trains on n1 and n2. n1, where Slurm runs the
    batch script (and the supervisor, and process 0 with the coordinator), dies: marked DOWN, its slurmd and
    everything of the job on it SIGKILLed (the batch script's and the task's slurmstepd, and all under them). Nothing
    in the job is left to restart it; the successor job the script submitted at its start (afternotok) runs on n2
    and n3, resumes from the newest checkpoint, takes run.dir over and finishes with the uninterrupted run's losses
    bit for bit (two processes, as before)."""
    run_dir = tmp_path / "first"
    log_file = Path(f"{run_dir}.out")
    job_id = submit(cluster, run_dir, spares=1)
    wait_for(lambda: saved(run_dir, 8), 180, "step 8's checkpoint")
    waiting = log_file.read_text().split("slurm.sbatch: job ", 1)[1].split()[0]  # the successor
    assert cluster.job(waiting)["JobState"] == "PENDING" and "afternotok" in cluster.job(waiting)["Dependency"]
    slurmd = int((cluster.directory / "slurmd-n1.pid").read_text())
    doomed = [slurmd, *descendants(parent(batch_script_pid(job_id))), *descendants(parent(task_pid(run_dir, 0)))]
    try:
        for pid in doomed:  # the node dies first; Slurm learns of it after (its slurmd no longer answers)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        cluster.run("scontrol", "update", "NodeName=n1", "State=DOWN", "Reason=test_slurm")
        failed = finished(cluster, job_id, run_dir)
        successor = finished(cluster, waiting, run_dir)
    finally:  # n1 repaired: its slurmd back, the node in service
        cluster.run("slurmd", "-f", str(cluster.directory / "slurm.conf"), "-N", "n1", check=False)
        cluster.run("scontrol", "update", "NodeName=n1", "State=RESUME", check=False)
    log = log_file.read_text()
    # The job, left running on n2 and n3 without its batch script, ended by the watch on n2.
    assert failed["JobState"] == "CANCELLED", log[-3000:]
    assert "slurm_guard: the first node n1 failed and took the batch script with it; ending job" in log, log[-3000:]
    assert successor["JobState"] == "COMPLETED", log[-3000:]
    after = log.partition(f"slurm.sbatch: job {waiting} waits")[2]
    assert "slurm_step: on n2 n3" in after and "resumed from" in after, log[-3000:]
    assert losses(run_dir) == uninterrupted
    # The successor's own successor, cancelled when it finished: nothing is left waiting.
    assert cluster.run("squeue", "-h", "-o", "%i %T %E").strip() == "", log[-3000:]
