"""Multi-process training with real processes: jax.distributed over 127.0.0.1, CPU collectives.

launch/local.sh --processes N --devices D (launch/multiprocess.py) starts N processes x D simulated devices; every run here has 8 devices in all,
so the mesh (fsdp=8) and the numbers are those of one process with 8 devices.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import write_tiny_yaml

from llama_jax.checkpoint import latest_checkpoint_step
from llama_jax.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launch" / "multiprocess.py"
STEPS = 14


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    """A tiny model with a constant learning rate, so a run raised from 10 to 14 steps follows a 14-step run."""
    return write_tiny_yaml(tmp_path_factory.mktemp("multihost"), train={"steps": STEPS, "min_lr_ratio": 1.0})


def environment():
    return dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", LLAMA_JAX=str(Path(sys.executable).parent / "llama-jax"))


def launch(processes, devices, *args, timeout=300, command=None):
    """launch/local.sh, as the README's multi-host guide runs it (it hands several processes to LAUNCHER),
    each process running `command train ARGS` (default: the llama-jax CLI)."""
    env = environment() | ({"LLAMA_JAX": command} if command else {})
    return subprocess.run([str(ROOT / "launch" / "local.sh"), "--processes", str(processes), "--devices", str(devices),
                           "--", "train", *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout)


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
    script.write_text("import sys\nfrom llama_jax import api\n"  # argv: train CONFIG key=value ...
                      "sys.exit(api.train(sys.argv[2], sys.argv[3:])['exit_code'])\n")
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
def test_a_two_process_checkpoint_resumes_with_another_process_count(processes, two_processes, one_process,
                                                                    config_path, tmp_path):
    saved, _ = two_processes
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    proc = launch(processes, 8 // processes, config_path, f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {run_dir / 'checkpoints' / '10'}" in proc.stdout
    close(losses(run_dir), one_process, range(11, STEPS + 1))


def test_killing_one_process_stops_the_other_and_the_supervisor_resumes_both(config_path, one_process, tmp_path):
    run_dir = tmp_path / "run"
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "llama_jax", "supervise", "--backoff", "0.5", "--", sys.executable, str(LAUNCHER),
         "--processes", "2", "--devices", "4", "--", "train", str(config_path), f"run.dir={run_dir}",
         "run.heartbeat_timeout_s=10", "train.steps=30"],
        env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Wait until the run is past a checkpoint, then SIGKILL process 1 (pids from the launcher's log).
    log_lines: list[str] = []
    deadline = time.time() + 240
    while time.time() < deadline and latest_checkpoint_step(run_dir) < 4:
        assert supervisor.poll() is None, supervisor.communicate()
        time.sleep(0.1)
    assert latest_checkpoint_step(run_dir) >= 4
    pids = {}
    while len(pids) < 2:
        line = supervisor.stderr.readline()
        log_lines.append(line)
        if match := re.match(r"multiprocess: process (\d) started \(pid (\d+)\)", line):
            pids[int(match.group(1))] = int(match.group(2))
    os.kill(pids[1], signal.SIGKILL)
    out, err = supervisor.communicate(timeout=400)
    err = "".join(log_lines) + err
    assert supervisor.returncode == 0, err
    died = float(re.search(r"process 1 exited with status 137 after ([\d.]+)s", err).group(1))
    survivor = float(re.search(r"process 0 exited with status \d+ after ([\d.]+)s", err).group(1))
    assert survivor - died < 60, err  # no hang in a collective waiting for the dead peer
    assert "still running" not in err  # it stopped by itself, the launcher did not have to kill it
    assert err.count("llama-jax supervise: start #") == 2
    assert "resumed from" in out
    straight = one_process
    got = losses(run_dir)
    close(got, straight, range(1, STEPS + 1))  # the first 14 steps of a constant-LR run equal the straight run's
    assert max(got) == 30


def test_sigterm_to_every_process_saves_one_agreed_step(config_path, tmp_path):
    """Preemption: both processes get SIGTERM (at slightly different steps) and save the same step."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([str(ROOT / "launch" / "local.sh"), "--processes", "2", "--devices", "4", "--", "train",
                             str(config_path), f"run.dir={run_dir}", "train.steps=2000", "checkpoint.every_steps=0"],
                            env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and max(losses(run_dir) if (run_dir / "metrics.jsonl").exists() else [], default=0) < 5:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # the launcher forwards it to both processes
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    saved = latest_checkpoint_step(run_dir)
    assert f"saved step {saved}, stopping (exit 75)" in out
    assert max(losses(run_dir)) == saved  # no step lost
    assert "process 0 exited with status 75" in err and "process 1 exited with status 75" in err
