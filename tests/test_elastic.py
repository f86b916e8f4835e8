"""Continuing on fewer hosts with real processes (launch/multiprocess.py --hosts): 4 processes -> one host lost for
good, its local storage with it -> 2 processes with twice the micro-batches, the same global batch, resuming from the
newest local step the 2 hosts hold between them (their own shards and their partners' copies, saved on 4) -> the
host returns -> 4 again; the loss curve is the uninterrupted run's and no step is lost beyond the local interval."""

import importlib.util
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
from conftest import Supervised, subprocess_environment, write_tiny_yaml

from llama_jax.checkpoint.local_files import host_directory
from llama_jax.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
# The local tier every INTERVAL steps, the durable one rarer (as launch/defaults.sh and the recipes set them).
STEPS, INTERVAL, DURABLE = 28, 2, 10


def losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    return {r["step"]: r["loss"] for r in read_metrics(path) if "loss" in r} if path.exists() else {}


@pytest.mark.slow
def test_four_processes_continue_on_two_when_a_host_is_lost_and_grow_back_to_four(tmp_path):
    local = tmp_path / "local"  # one local directory a simulated host inside it (checkpoint/local.py)
    config = write_tiny_yaml(
        tmp_path,
        train={"steps": STEPS, "min_lr_ratio": 1.0, "lr": 3e-3},
        checkpoint={"every_steps": DURABLE, "keep": 50, "local_dir": str(local), "local_every_steps": INTERVAL},
    )

    def train(processes: int, devices: int, directory: Path, *keys: str) -> None:
        proc = subprocess.run(
            [
                sys.executable,
                str(ROOT / "launch" / "multiprocess.py"),
                "--processes",
                str(processes),
                "--devices",
                str(devices),
                "--",
                "train",
                str(config),
                f"run.dir={directory}",
                *keys,
            ],
            env=subprocess_environment(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]

    straight = tmp_path / "straight"
    train(1, 4, straight)

    hosts, run_dir = tmp_path / "hosts.txt", tmp_path / "run"
    hosts.write_text("host-0\nhost-1\nhost-2\nhost-3\n")
    supervisor = Supervised(
        [
            sys.executable,
            "-m",
            "llama_jax",
            "supervise",
            "--backoff",
            "0.2",
            "--",
            sys.executable,
            str(ROOT / "launch" / "multiprocess.py"),
            "--processes",
            "4",
            "--devices",
            "1",
            "--grace",
            "10",
            "--hosts",
            str(hosts),
            "--replacement-wait",
            "2",
            "--",
            "train",
            str(config),
            f"run.dir={run_dir}",
            "run.heartbeat_timeout_s=10",
            "inject.process=0",
            "inject.step_delay_s=0.1",
        ],
        subprocess_environment(),
    )
    lines = supervisor.lines

    def wait_for(condition, what):
        deadline = time.time() + 240
        while not condition():
            assert time.time() < deadline and supervisor.poll() is None, f"{what}\n" + "".join(lines)[-6000:]
            time.sleep(0.05)

    # Process 0 takes 0.1 s more a step (the others wait for it): over 2 s between step 6 and the run's end.
    wait_for(lambda: max(losses(run_dir), default=0) >= 6, "4 processes reach step 6")
    started = (re.match(r"multiprocess: process 3 started \(pid (\d+)\)", line) for line in list(lines))
    hosts.write_text("host-0\nhost-1\nhost-2\n")  # host-3 is gone for good...
    os.kill(int(next(m.group(1) for m in started if m)), signal.SIGKILL)  # ...and its process with it...
    lost_at = max(losses(run_dir))
    shutil.rmtree(host_directory(str(local), run_dir, "host-3"))  # ...and its local storage
    wait_for(lambda: any("continuing on 2" in line for line in lines), "the launcher continues on 2 processes")
    shrunk_from = next(i for i, line in enumerate(lines) if "continuing on 2" in line)

    def trained():
        return [int(m.group(1)) for line in lines[shrunk_from:] if (m := re.search(r"step (\d+)/", line))]

    wait_for(lambda: max(trained(), default=0) > lost_at + 1, "2 processes train past the lost step")
    # Held still while the host returns, so the launcher sees it before these 2 finish the run (on a busy machine
    # they could otherwise outrun its once-a-second look); the SIGTERM it sends waits for SIGCONT.
    shrunk = [int(m.group(1)) for line in lines[shrunk_from:] if (m := re.search(r"started \(pid (\d+)\)", line))]
    assert len(shrunk) == 2, "".join(lines[shrunk_from:])
    for pid in shrunk:
        os.kill(pid, signal.SIGSTOP)
    try:
        hosts.write_text("host-0\nhost-1\nhost-2\nhost-3\n")  # the host returns
        wait_for(lambda: any("the missing hosts are back" in line for line in lines), "the launcher sees the host")
    finally:
        for pid in shrunk:
            os.kill(pid, signal.SIGCONT)
    assert supervisor.wait(timeout=300) == 0, "".join(lines)[-6000:]
    log = "".join(lines)
    assert "train.microbatches 1 -> 2, the same global batch" in log
    assert "the missing hosts are back" in log and log.count("llama-jax supervise: start #") == 3
    resumed = [int(m) for m in re.findall(r"resumed from \S+/(\d+)\n", log)]
    # Lost: at most the local interval. Hosts 0 and 2 (every other one of the ring) run on: host 0 keeps process 3's
    # partner copy, host 2 process 1's, so the step comes from the local tier, laid out on 2 processes.
    assert "continuing on 2 (host-0, host-2)" in log
    assert len(resumed) == 2 and lost_at - resumed[0] <= INTERVAL, (resumed, lost_at, log[-6000:])
    assert (
        f"restored step {resumed[0]} from the local tier (the shards of 4 processes, read on processes 0, 1 of 2)"
        in log
    ), log[-6000:]
    got, want = losses(run_dir), losses(straight)
    assert max(got) == STEPS
    # Other process counts sum in other orders: the same math, not the same bits. At lr 3e-3 those last-bit
    # differences stay at most 2e-7 for 30 steps (uninterrupted runs of 1x4, 4x1 and 2x1 devices with 2
    # micro-batches); at lr 1e-2 they reach 1e-5 by step 28 and 2e-4 at step 29, and this check sat on that edge.
    np.testing.assert_allclose([got[s] for s in range(1, STEPS + 1)], [want[s] for s in range(1, STEPS + 1)], rtol=1e-5)


def test_on_half_the_hosts_the_launcher_runs_on_every_other_host_of_the_ring():
    """Process i's partner copy is on the next host of the ring (the order of the last start on all of them), so
    every other host holds every process's local shards between them; otherwise the first usable hosts."""
    spec = importlib.util.spec_from_file_location("multiprocess", ROOT / "launch" / "multiprocess.py")
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    ring = ["h0", "h1", "h2", "h3"]
    assert launcher.choose_hosts(["h0", "h1", "h2"], 4, ring) == ["h0", "h2"]
    assert launcher.choose_hosts(["h1", "h2", "h3"], 4, ring) == ["h1", "h3"]
    assert launcher.choose_hosts(["h2", "h3"], 4, ring) == ["h2", "h3"]  # two neighbours gone: no covering pair
    assert launcher.choose_hosts(["h3", "h0", "h1", "h2"], 4, ring) == ["h3", "h0", "h1", "h2"]  # all: FILE's order
    assert launcher.choose_hosts(["h0", "h1", "h2"], 4, []) == ["h0", "h1"]  # no ring recorded
    assert launcher.choose_hosts(list("abcdefg"), 8, list("abcdefgh")) == ["a", "c", "e", "g"]
    assert launcher.choose_hosts(list("abc"), 8, list("abcdefgh")) == ["a", "b"]  # a quarter: no covering pair
