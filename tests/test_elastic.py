"""Continuing on fewer hosts with real processes (launch/multiprocess.py --hosts): 4 processes -> one host lost for
good -> 2 processes with twice the micro-batches, the same global batch -> the host returns -> 4 again; the loss
curve is the uninterrupted run's and no step is lost beyond the checkpoint interval."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from conftest import Supervised, write_tiny_yaml

from llama_jax.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
STEPS, INTERVAL = 28, 2


def environment():
    return dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", LLAMA_JAX=str(Path(sys.executable).parent / "llama-jax"))


def losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    return {r["step"]: r["loss"] for r in read_metrics(path) if "loss" in r} if path.exists() else {}


def test_four_processes_continue_on_two_when_a_host_is_lost_and_grow_back_to_four(tmp_path):
    config = write_tiny_yaml(tmp_path, train={"steps": STEPS, "min_lr_ratio": 1.0},
                             checkpoint={"every_steps": INTERVAL, "keep": 50})
    straight = tmp_path / "straight"
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "multiprocess.py"), "--processes", "1", "--devices",
                           "4", "--", "train", str(config), f"run.dir={straight}"],
                          env=environment(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]

    hosts, run_dir = tmp_path / "hosts.txt", tmp_path / "run"
    hosts.write_text("host-0\nhost-1\nhost-2\nhost-3\n")
    supervisor = Supervised(
        [sys.executable, "-m", "llama_jax", "supervise", "--backoff", "0.2", "--", sys.executable,
         str(ROOT / "launch" / "multiprocess.py"), "--processes", "4", "--devices", "1", "--grace", "10",
         "--hosts", str(hosts), "--replacement-wait", "2", "--", "train", str(config), f"run.dir={run_dir}",
         "run.heartbeat_timeout_s=10"],
        environment())
    lines = supervisor.lines

    def wait_for(condition, what):
        deadline = time.time() + 240
        while not condition():
            assert time.time() < deadline and supervisor.poll() is None, f"{what}\n" + "".join(lines)[-6000:]
            time.sleep(0.05)

    wait_for(lambda: max(losses(run_dir), default=0) >= 6, "4 processes reach step 6")
    started = (re.match(r"multiprocess: process 3 started \(pid (\d+)\)", line) for line in list(lines))
    hosts.write_text("host-0\nhost-1\nhost-2\n")  # host-3 is gone for good...
    os.kill(int(next(m.group(1) for m in started if m)), signal.SIGKILL)  # ...and its process with it
    lost_at = max(losses(run_dir))
    wait_for(lambda: any("continuing on 2" in line for line in lines), "the launcher continues on 2 processes")
    shrunk_from = len(lines)
    trained = (lambda: [int(m.group(1)) for line in lines[shrunk_from:] if (m := re.search(r"step (\d+)/", line))])
    wait_for(lambda: max(trained(), default=0) > lost_at + 1, "2 processes train past the lost step")
    hosts.write_text("host-0\nhost-1\nhost-2\nhost-3\n")  # the host returns
    assert supervisor.wait(timeout=300) == 0, "".join(lines)[-6000:]
    log = "".join(lines)
    assert "train.microbatches 1 -> 2, the same global batch" in log
    assert "the missing hosts are back" in log and log.count("llama-jax supervise: start #") == 3
    resumed = [int(m) for m in re.findall(r"resumed from \S+/checkpoints/(\d+)", log)]
    # Lost: at most the interval, and the save of the step at the interval when it was still being written.
    assert len(resumed) == 2 and lost_at - resumed[0] <= 2 * INTERVAL, (resumed, lost_at)
    got, want = losses(run_dir), losses(straight)
    assert max(got) == STEPS
    np.testing.assert_allclose([got[s] for s in range(1, STEPS + 1)], [want[s] for s in range(1, STEPS + 1)], rtol=1e-5)
