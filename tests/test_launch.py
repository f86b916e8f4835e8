"""launch/ scripts: each is exercised (dry-run output checked, and the local launcher really run)."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from test_readme import readme_commands

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ROOT / "launch" / "local.sh"


def local(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | (env_extra or {})
    env["LLAMA_JAX"] = str(Path(sys.executable).parent / "llama-jax")
    return subprocess.run([str(LOCAL), *args], capture_output=True, text=True, env=env, cwd=ROOT)


def test_dry_run_prints_the_exact_command():
    result = local("--devices", "4", "--dry-run", "tiny", "mesh.data=2", "run.dir=runs/a b")
    assert result.returncode == 0
    words = shlex.split(result.stdout)
    assert words[:2] == ["XLA_FLAGS=--xla_force_host_platform_device_count=4", "JAX_PLATFORMS=cpu"]
    assert words[2].endswith("llama-jax") and words[3:] == ["train", "tiny", "mesh.data=2", "run.dir=runs/a b"]


def test_existing_xla_flags_are_kept():
    result = local("--dry-run", "plan", "bench", env_extra={"XLA_FLAGS": "--xla_dump_to=/tmp/x"})
    assert "XLA_FLAGS=--xla_dump_to=/tmp/x\\ --xla_force_host_platform_device_count=8" in result.stdout
    assert " plan bench" in result.stdout


def test_bad_device_count_exits_2():
    result = local("--devices", "0", "tiny")
    assert result.returncode == 2 and "--devices must be a positive integer" in result.stderr


def test_local_launcher_really_runs_on_simulated_devices():
    result = local("--devices", "2", "plan", "tiny", "model.n_layers=1", "mesh.fsdp=2", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["devices"] == 2


def test_readme_local_commands_dry_run():
    commands = readme_commands("launch/local.sh")
    assert commands
    for command in commands:
        args = shlex.split(command)[1:]
        result = local("--dry-run", *args)
        assert result.returncode == 0 and "llama-jax train" in result.stdout
