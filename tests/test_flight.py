"""The flight recorder (resilience/flight.py) with real processes: a process stopped mid-step (SIGSTOP) is
named in <run.dir>/hang_report.json with its host and what it was doing, and the supervisor finishes the run."""

import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from conftest import Supervised, subprocess_environment, write_tiny_yaml

from llama_jax.resilience.flight import hang_report
from llama_jax.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return max((r["step"] for r in read_metrics(path) if "loss" in r), default=0) if path.exists() else 0


@pytest.mark.slow
def test_a_stopped_process_is_named_in_the_hang_report_and_the_supervisor_finishes_the_run(tmp_path):
    # A save is a phase with its own bound (checkpoint.timeout_s): none falls where the process is stopped (no
    # periodic saves; the restart trains from the start). Process 0 takes 0.2 s more a step (the others wait for
    # it in the step's collectives): over 2 s between step 4, when the stop is sent, and the run's end.
    config = write_tiny_yaml(tmp_path, train={"steps": 16, "min_lr_ratio": 1.0}, checkpoint={"every_steps": 0})
    run_dir = tmp_path / "run"
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
            "5",
            "--",
            "train",
            str(config),
            f"run.dir={run_dir}",
            "fault.hang_min_timeout_s=5",
            "fault.flight_heartbeat_s=0.5",
            "run.heartbeat_timeout_s=120",
            "inject.process=0",
            "inject.step_delay_s=0.2",
        ],
        subprocess_environment(),
    )
    lines = supervisor.lines
    deadline = time.time() + 240
    while time.time() < deadline and last_step(run_dir) < 4:
        assert supervisor.poll() is None, "".join(lines)
        time.sleep(0.05)
    started = (re.match(r"multiprocess: process 2 started \(pid (\d+)\)", line) for line in lines)
    pid = int(next(m.group(1) for m in started if m))
    os.kill(pid, signal.SIGSTOP)  # mid-step: the others wait for it in the step's collectives
    assert supervisor.wait(timeout=300) == 0, "".join(lines)
    log = "".join(lines)
    assert (run_dir / "hang_report.json").is_file(), log[-6000:]
    report = json.loads((run_dir / "hang_report.json").read_text())
    assert [(w["process"], w["host"]) for w in report["waiting_for"]] == [(2, socket.gethostname())], report
    assert re.search(r"step \d+", report["waiting_for"][0]["phase"]), report  # what it was doing when stopped
    assert report["why"].startswith("heartbeat stopped") and "no progress" in report["reason"]
    assert len(report["processes"]) == 4 and report["reported_by"] != 2
    assert "flight/process-2.json" not in report["records"] and len(report["records"]) == 3  # the reachable ones
    record = json.loads((run_dir / "flight" / f"process-{report['reported_by']}.json").read_text())
    assert record["recent_events"] and record["recent_events"][-1]["kind"] == "hang"
    assert "hang watchdog fired" in log and log.count("llama-jax supervise: start #") == 2
    assert last_step(run_dir) == 16


def test_without_the_coordination_service_the_processes_that_wrote_no_record_are_waited_for():
    records = {
        0: {
            "process": 0,
            "host": "a",
            "step": 7,
            "phase": "waiting for step 7's result",
            "since": 99.0,
            "beat": 100.0,
            "exiting": True,
        },
        2: {"process": 2, "host": "c", "step": 7, "phase": "waiting for step 7's result", "since": 99.0, "beat": 100.0},
    }
    report = hang_report("no progress", 0, 3, None, records, None, stale_after_s=1.5, now=100.5)
    assert [w["process"] for w in report["waiting_for"]] == [1]
    assert report["why"].startswith("wrote no record")
