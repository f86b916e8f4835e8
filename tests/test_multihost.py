"""Multi-process training with real processes: jax.distributed over 127.0.0.1, CPU collectives.

launch/local.sh --processes N --devices D (launch/multiprocess.py) starts N processes x D simulated
devices; every run here has 8 devices in all, so the mesh (fsdp=8) and the numbers are those of one
process with 8 devices.
"""

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import subprocess_environment, write_tiny_yaml

from llama_jax.checkpoint.durable import latest_checkpoint_step
from llama_jax.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launch" / "multiprocess.py"
# Every test here runs real processes (minutes on CI's 2 cores): the newest-jax leg leaves them out.
pytestmark = pytest.mark.slow

STEPS = 14


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    """A tiny model with a constant learning rate, so a run raised from 10 to 14 steps follows a 14-step run."""
    return write_tiny_yaml(tmp_path_factory.mktemp("multihost"), train={"steps": STEPS, "min_lr_ratio": 1.0})


def launch(processes, devices, *args, timeout=300, command=None):
    """launch/local.sh, as the README's multi-host guide runs it (it hands several processes to LAUNCHER),
    each process running `command train ARGS` (default: the llama-jax CLI)."""
    env = subprocess_environment() | ({"LLAMA_JAX": command} if command else {})
    return subprocess.run(
        [
            str(ROOT / "launch" / "local.sh"),
            "--processes",
            str(processes),
            "--devices",
            str(devices),
            "--",
            "train",
            *map(str, args),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def one_process(config_path, tmp_path_factory):
    """Losses of the straight run: 1 process x 8 devices, 14 steps."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    proc = launch(1, 8, config_path, f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    return losses(run_dir)


@pytest.fixture(scope="module")
def two_processes(config_path, tmp_path_factory):
    """A run of 2 processes x 4 devices stopped at step 10 (its checkpoint is the resume tests' start), each
    process calling the Python API's train, which joins the run from the JAX_* variables the launcher sets."""
    root = tmp_path_factory.mktemp("two")
    script = root / "train_with_api.py"
    script.write_text(
        "import sys\nfrom llama_jax import api\n"  # argv: train CONFIG key=value ...
        "sys.exit(api.train(sys.argv[2], sys.argv[3:])['exit_code'])\n"
    )
    proc = launch(2, 4, config_path, f"run.dir={root / 'run'}", "train.steps=10", command=f"{sys.executable} {script}")
    assert proc.returncode == 0, proc.stderr
    return root / "run", proc


def close(a: dict, b: dict, steps) -> None:
    np.testing.assert_allclose([a[s] for s in steps], [b[s] for s in steps], rtol=1e-5)


def test_two_processes_via_the_api_train_like_one_and_only_process_0_writes_the_log(two_processes, one_process):
    run_dir, proc = two_processes
    close(losses(run_dir), one_process, range(1, 11))
    assert proc.stdout.count("step 10/10 | loss") == 1  # one voice: process 0's
    assert "multiprocess: process 0 exited with status 0" in proc.stderr
    assert "multiprocess: process 1 exited with status 0" in proc.stderr
    records = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert records == list(range(1, 11))  # not one record per process
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["steps"] == 10
    meta = json.loads((run_dir / "checkpoints" / "10" / "meta" / "metadata").read_text())
    assert meta["processes"] == 2 and meta["devices"] == 8


@pytest.mark.parametrize("processes", [1, 4])
def test_a_two_process_checkpoint_resumes_with_another_process_count(
    processes, two_processes, one_process, config_path, tmp_path
):
    saved, _ = two_processes
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    proc = launch(processes, 8 // processes, config_path, f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {run_dir / 'checkpoints' / '10'}" in proc.stdout
    close(losses(run_dir), one_process, range(11, STEPS + 1))


def test_sigterm_to_every_process_saves_one_agreed_step(config_path, tmp_path):
    """Preemption: both processes get SIGTERM (at slightly different steps) and save the same step."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            str(ROOT / "launch" / "local.sh"),
            "--processes",
            "2",
            "--devices",
            "4",
            "--",
            "train",
            str(config_path),
            f"run.dir={run_dir}",
            "train.steps=2000",
            "checkpoint.every_steps=0",
        ],
        env=subprocess_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 240
    while (
        time.time() < deadline and max(losses(run_dir) if (run_dir / "metrics.jsonl").exists() else [], default=0) < 5
    ):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # the launcher forwards it to both processes
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    saved = latest_checkpoint_step(run_dir)
    assert f"saved step {saved}, stopping (exit 75)" in out
    assert max(losses(run_dir)) == saved  # no step lost
    assert "process 0 exited with status 75" in err and "process 1 exited with status 75" in err


# ---------------------------------------------------------------------------------------------
# One decision for every process (issue 19): each test below would hang or diverge if a process decided alone.


def launcher(processes, devices, *args, grace=90, timeout=300):
    """launch/multiprocess.py directly, for its --grace (how long the others get after one fails)."""
    return subprocess.run(
        [
            sys.executable,
            str(LAUNCHER),
            "--processes",
            str(processes),
            "--devices",
            str(devices),
            "--grace",
            str(grace),
            "--",
            "train",
            *map(str, args),
        ],
        env=subprocess_environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def resumable(two_processes, tmp_path):
    """A copy of the two-process run (checkpoints at steps 2, 4, ..., 10) to damage or resume."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_processes[0], run_dir)
    return run_dir


def test_damage_in_one_processs_files_sets_the_step_aside_on_every_process(resumable, one_process, config_path):
    """Only process 1 reads the damaged files of step 10 (its own shards); both must fall back to step 8."""
    shards = sorted((resumable / "checkpoints" / "10" / "state").glob("ocdbt.process_1/d/*"))
    assert shards, "expected process 1's OCDBT shard files"
    for shard in shards:
        shard.write_bytes(b"")
    proc = launch(2, 4, config_path, f"run.dir={resumable}")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"checkpoint step 10 does not restore \(process 1: ", proc.stdout), proc.stdout
    assert f"resumed from {resumable / 'checkpoints' / '8'}" in proc.stdout
    assert [p.name.split("-")[0] for p in (resumable / "checkpoints" / "corrupt").iterdir()] == ["10"]
    close(losses(resumable), one_process, range(9, STEPS + 1))


def test_resuming_with_another_rope_theta_exits_2_naming_it_and_changes_nothing(resumable, config_path):
    before = {p: p.stat().st_mtime_ns for p in resumable.rglob("*")}
    proc = launch(2, 4, config_path, f"run.dir={resumable}", "model.rope_theta=20000")
    assert proc.returncode == 2, proc.stderr
    assert "model.rope_theta 10000.0 (saved) vs 20000.0" in proc.stderr
    assert "checkpoint.allow_model_changes=[rope_theta]" in proc.stderr
    assert {p: p.stat().st_mtime_ns for p in resumable.rglob("*")} == before


@pytest.fixture(scope="module")
def llama3_store(config_path, corpus):
    """A token store of the test corpus with its own byte-level BPE: the data a Llama 3 preset must be given."""
    store = config_path.parent / "store"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_jax",
            "prepare",
            str(corpus),
            "--out",
            str(store),
            "--train-tokenizer",
            "300",
            "--workers",
            "1",
        ],
        env=subprocess_environment(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    return store


def test_a_llama3_recipe_on_two_processes_saves_at_young_daly_and_a_kill_loses_at_most_one_interval(
    config_path, llama3_store, tmp_path
):
    """The llama3_8b preset as launched (only the model shrunk, its data named) on 2 processes under the supervisor.
    Process 1 is slow twice over: its saves take 0.6 s and each of its steps starts 0.3 s late.
    - The automatic interval is agreed by both processes (each alone would choose another: they would save at
      different steps and wait in Orbax's collectives forever) and is Young/Daly's on the figures measured, which
      hold those delays (idle, ~9.8 steps: sqrt(2 x 0.6 s x MTBF) / 0.3 s; fewer on a busy machine);
    - process 1 is named as the straggler host, and goodput charged;
    - SIGKILL to process 1 after a few saves: process 0 stops by itself (no hang in a collective waiting for its
      peer), the supervisor restarts both, which lose at most one interval."""
    run_dir = tmp_path / "run"
    step_s, save_s, mtbf_hours, steps = 0.3, 0.6, 0.002, 36
    overrides = [
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
        f"train.steps={steps}",
        "train.warmup_steps=2",
        "train.eval_every=0",
        "train.sample_tokens=0",
        f"data.sources=[{llama3_store}]",
        f"data.cache_dir={config_path.parent / 'cache'}",
        "run.tensorboard=false",
        f"checkpoint.mtbf_hours={mtbf_hours}",
        "checkpoint.keep=50",
        "fault.straggler_every_steps=3",
        "inject.process=1",
        f"inject.save_delay_s={save_s}",
        f"inject.step_delay_s={step_s}",
        "fault.barrier_timeout_s=60",
        "run.heartbeat_timeout_s=10",
    ]
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_jax",
            "supervise",
            "--backoff",
            "0.5",
            "--",
            sys.executable,
            str(LAUNCHER),
            "--processes",
            "2",
            "--devices",
            "4",
            "--",
            "train",
            "llama3_8b",
            f"run.dir={run_dir}",
            *overrides,
        ],
        env=subprocess_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids, log_lines = {}, []
    while len(pids) < 2:
        line = supervisor.stderr.readline()
        assert line, supervisor.communicate()
        log_lines.append(line)
        if match := re.match(r"multiprocess: process (\d) started \(pid (\d+)\)", line):
            pids[int(match.group(1))] = int(match.group(2))
    deadline = time.time() + 300
    while (
        time.time() < deadline and max(losses(run_dir) if (run_dir / "metrics.jsonl").exists() else [], default=0) < 23
    ):
        assert supervisor.poll() is None, supervisor.communicate()
        time.sleep(0.1)
    killed_at = max(losses(run_dir))
    os.kill(pids[1], signal.SIGKILL)
    out, err = supervisor.communicate(timeout=400)
    err = "".join(log_lines) + err
    assert supervisor.returncode == 0, err
    assert err.count("llama-jax supervise: start #") == 2
    died = float(re.search(r"process 1 exited with status 137 after ([\d.]+)s", err).group(1))
    survivor = float(re.search(r"process 0 exited with status \d+ after ([\d.]+)s", err).group(1))
    assert survivor - died < 60, err  # no hang in a collective waiting for the dead peer
    assert "still running" not in err  # it stopped by itself, the launcher did not have to kill it

    derived = re.search(
        r"checkpoint.every_steps=auto: sqrt\(2 x save ([\d.]+)s x MTBF \S+ h\) = \d+s at ([\d.]+)s a "
        r"step -> saving every (\d+) steps",
        out,
    )
    save, step, every = float(derived.group(1)), float(derived.group(2)), int(derived.group(3))
    # Process 1's figures are the agreed ones (its delays are in them); the rest of a step is this machine's
    # compute, longer when the machine is busy, so the interval is checked against the figures it measured.
    assert save >= save_s and step >= step_s, derived.group(0)
    assert abs(every - math.sqrt(2 * save * mtbf_hours * 3600) / step) <= 1, derived.group(0)  # ~9.8 steps idle
    attempts = json.loads((run_dir / "goodput.json").read_text())["attempts"]
    assert attempts[-1]["redone_steps"] <= every, (killed_at, attempts[-1]["redone_steps"], every)
    assert max(losses(run_dir)) == steps

    line = re.search(
        r"warning: straggler host: process 1 on \S+ \(devices \d+-\d+\) costs the fleet ([\d.]+) s of "
        r"each ([\d.]+) s step over steps \d+-\d+ \(score ([\d.]+) > .*",
        out,
    )
    assert line, out
    cost, _, score = map(float, line.groups())
    assert 0.25 < cost < 0.45 and score > 0.1  # the injected 0.3 s less the other host's few ms
    assert "straggler host: process 0" not in out
    assert attempts[0]["buckets"]["straggler"] > 0.25 * 3  # at least one window of 3 slow steps
    assert [h["process"] for h in attempts[0]["hosts"] if h["straggler"]] == [1]


def test_a_process_that_never_reaches_a_barrier_is_named_by_the_others(config_path, tmp_path):
    run_dir = tmp_path / "run"
    proc = launcher(
        2,
        4,
        config_path,
        f"run.dir={run_dir}",
        "inject.process=1",
        "inject.stall_at=restore",
        "fault.barrier_timeout_s=5",
        grace=5,
    )
    assert "'restore': process 1 of 2 did not arrive within 5s" in proc.stderr, proc.stderr
    assert f"on {socket.gethostname()} (process 1)" in proc.stderr  # where to look for it
    assert re.search(r"process 0 exited with status 76 after", proc.stderr), proc.stderr
    assert proc.returncode == 76
