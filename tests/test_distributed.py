"""Who a process is in a multi-process run (config, environment, cluster detection) and the errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llama_jax.config import RunConfig
from llama_jax.distributed.processes import Membership, membership
from llama_jax.errors import EXIT_UNAVAILABLE, ConfigError

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_VARIABLES = (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "SLURM_JOB_ID",
    "SLURM_NTASKS",
    "SLURM_STEP_NODELIST",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_MCA_orte_hnp_uri",
)


@pytest.fixture
def env(monkeypatch):
    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_nothing_set_is_a_single_process(env):
    assert membership(RunConfig()) is None
    assert membership(RunConfig(coordinator="h:1", num_processes=1, process_id=0)) is None


def test_config_keys_then_environment(env):
    explicit = RunConfig(coordinator="host0:1234", num_processes=4, process_id=2)
    assert membership(explicit) == Membership("host0:1234", 4, 2, None)
    env.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:999")
    env.setenv("JAX_NUM_PROCESSES", "8")
    env.setenv("JAX_PROCESS_ID", "7")
    assert membership(RunConfig()) == Membership("10.0.0.1:999", 8, 7, None)
    assert membership(explicit) == Membership("host0:1234", 4, 2, None)  # the config wins


def test_slurm_is_left_to_jax_detection(env):
    env.setenv("SLURM_JOB_ID", "42")
    env.setenv("SLURM_STEP_NODELIST", "gpu[1-2]")
    env.setenv("SLURM_NTASKS", "16")
    assert membership(RunConfig()) == Membership(None, None, None, "slurm")
    env.setenv("SLURM_NTASKS", "1")  # a one-task job (e.g. an interactive allocation) is one process
    assert membership(RunConfig()) is None


@pytest.mark.parametrize(
    "run, message",
    [
        (RunConfig(coordinator="host0:1234"), r"needs run.num_processes \(or JAX_NUM_PROCESSES\), run.process_id"),
        (RunConfig(coordinator="host0:1234", num_processes=2, process_id=2), r"run.process_id must be in \[0, 2\)"),
        (RunConfig(coordinator="host0", num_processes=2, process_id=0), "run.coordinator must be HOST:PORT"),
    ],
)
def test_incomplete_or_inconsistent_settings_name_the_fix(env, run, message):
    with pytest.raises(ConfigError, match=message):
        membership(run)


def test_unreachable_coordinator_is_one_line_and_exit_69(tmp_path):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES} | {"JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_jax",
            "train",
            "train.steps=1",
            "train.warmup_steps=0",
            f"run.dir={run_dir}",
            "run.coordinator=127.0.0.1:1",
            "run.num_processes=2",
            "run.process_id=1",
            "run.init_timeout_s=2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == EXIT_UNAVAILABLE
    assert proc.stderr.strip().startswith("llama-jax: error: process 1 could not reach the coordinator at 127.0.0.1:1")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not run_dir.exists()


def test_bad_data_stops_every_process_with_exit_2(tmp_path):
    """Process 0 finds the problem; the others hear of it instead of waiting for process 0 forever."""
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES and k != "XLA_FLAGS"}
    env["LLAMA_JAX"] = f"{sys.executable} -m llama_jax"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch" / "multiprocess.py"),
            "--processes",
            "2",
            "--devices",
            "1",
            "--",
            "train",
            f"data.sources=[{tmp_path / 'missing.jsonl'}]",
            f"run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("llama-jax: error:")]
    assert len(errors) == 2
    assert any("missing.jsonl" in e for e in errors)
    assert any("process 0 stopped on bad input" in e for e in errors)
    assert not (tmp_path / "run").exists()
