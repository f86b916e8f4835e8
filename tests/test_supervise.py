"""`llama-jax supervise` with real child processes and real signals (tiny scripts, not the trainer)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llama_jax import cli
from llama_jax.errors import EXIT_BAD_INPUT, EXIT_HANG, EXIT_OK, EXIT_PREEMPTED, EXIT_UNHEALTHY

REPO = Path(__file__).resolve().parents[1]

# argv: COUNTER PLAN [ignored ...]. Counts its starts in COUNTER, then plays step #start of PLAN (the last
# step repeats): "N" exits N, "N@S" sleeps S seconds then exits N, "kill" SIGKILLs itself.
SCRIPTED_CHILD = """
import os, signal, sys, time
from pathlib import Path
counter, plan = Path(sys.argv[1]), sys.argv[2].split(",")
starts = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(starts + 1))
step = plan[min(starts, len(plan) - 1)]
if step == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
code, _, seconds = step.partition("@")
time.sleep(float(seconds or 0))
sys.exit(int(code))
"""

# argv: DIR [ignore]. Like the trainer: on SIGTERM writes DIR/got_signal (the signal number) and exits 75;
# with "ignore" it ignores SIGTERM. Writes DIR/ready once the handler is in place, then waits.
SIGNALLED_CHILD = """
import signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
with open(out / "starts", "a") as f:
    f.write("x")
def on_term(signum, frame):
    (out / "got_signal").write_text(str(signum))
    sys.exit(75)
signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[2:] == ["ignore"] else on_term)
(out / "ready").write_text("")
time.sleep(30)
"""


@pytest.fixture
def scripted(tmp_path):
    """Runs the supervisor in-process around SCRIPTED_CHILD; returns (status, starts, stderr)."""
    child = tmp_path / "child.py"
    child.write_text(SCRIPTED_CHILD)
    counter = tmp_path / "starts"

    def run(capsys, plan: str, *options: str, extra: tuple[str, ...] = ()) -> tuple[int, int, str]:
        counter.unlink(missing_ok=True)
        status = cli.main(
            ["supervise", "--backoff", "0.05", *options, "--", sys.executable, str(child), str(counter), plan, *extra]
        )
        return status, int(counter.read_text()), capsys.readouterr().err

    return run


def waits(stderr: str) -> list[float]:
    return [float(w) for w in re.findall(r"restart \d+ of \d+ in ([\d.]+)s", stderr)]


def test_failures_then_success_with_doubling_backoff(scripted, capsys):
    status, starts, err = scripted(capsys, "1,kill,0")
    assert (status, starts) == (EXIT_OK, 3), err
    assert waits(err) == [0.05, 0.1]
    assert "failed (exit 1)" in err and "killed by SIGKILL (exit -9)" in err and "#3 finished" in err
    assert all(line.startswith("llama-jax supervise: ") for line in err.splitlines())


def test_bad_input_is_never_restarted(scripted, capsys):
    status, starts, err = scripted(capsys, "2,0")
    assert (status, starts) == (EXIT_BAD_INPUT, 1), err
    assert "not restarting" in err.splitlines()[-1]


def test_an_unhealthy_device_is_never_restarted(scripted, capsys):
    status, starts, err = scripted(capsys, f"{EXIT_UNHEALTHY},0")
    assert (status, starts) == (EXIT_UNHEALTHY, 1), err
    assert f"#1 unhealthy device (exit {EXIT_UNHEALTHY})" in err
    assert "pre-flight check named an unhealthy device" in err and "not restarting" in err.splitlines()[-1]


# argv: run.dir=DIR CODE. Writes DIR/unhealthy.json as the pre-flight check does, then exits CODE, or is
# SIGKILLed with "kill" (as srun --kill-on-bad-exit may report the tasks it stopped).
VERDICT_CHILD = """
import os, signal, sys
from pathlib import Path
(Path(sys.argv[1].split("=", 1)[1]) / "unhealthy.json").write_text('{"hosts": ["node-7"]}')
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.parametrize("code", ["kill", "1"])
def test_an_attempt_that_wrote_a_pre_flight_verdict_is_not_restarted_whatever_its_status(tmp_path, capsys, code):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "child.py").write_text(VERDICT_CHILD)
    status = cli.main(
        ["supervise", "--backoff", "0.05", "--", sys.executable, str(tmp_path / "child.py"), f"run.dir={run_dir}", code]
    )
    err = capsys.readouterr().err
    assert status == EXIT_UNHEALTHY, err
    assert "this attempt's pre-flight check wrote" in err and "not restarting" in err.splitlines()[-1]
    (record,) = [json.loads(line) for line in (run_dir / "supervisor.jsonl").read_text().splitlines()]
    assert record["exit_code"] == EXIT_UNHEALTHY and record["action"] == "stop"


@pytest.mark.parametrize("age_s", [3600, 0])
def test_an_older_pre_flight_verdict_does_not_stop_a_restart(scripted, capsys, tmp_path, age_s):
    """A previous job's verdict, an hour old or written just before this attempt started (a job relaunched
    within a second of a pre-flight refusal), is not this attempt's."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    verdict = run_dir / "unhealthy.json"
    verdict.write_text('{"hosts": ["node-7"]}')
    os.utime(verdict, (time.time() - age_s, time.time() - age_s))
    status, starts, err = scripted(capsys, "1,0", extra=(f"run.dir={run_dir}",))
    assert (status, starts) == (EXIT_OK, 2), err


@pytest.mark.parametrize("plan, last_status", [("3", 3), ("kill", 1)])
def test_gives_up_after_max_restarts_with_the_last_status(scripted, capsys, plan, last_status):
    status, starts, err = scripted(capsys, plan, "--max-restarts", "3", "--max-backoff", "0.08")
    assert (status, starts) == (last_status, 4), err
    assert waits(err) == [0.05, 0.08, 0.08]  # doubling, capped by --max-backoff
    assert f"giving up after 3 restarts in a row; last status {last_status}" in err.splitlines()[-1]


def test_hang_and_preemption_exits_are_restarted(scripted, capsys):
    status, starts, err = scripted(capsys, f"{EXIT_HANG},{EXIT_PREEMPTED},0")
    assert (status, starts) == (EXIT_OK, 3), err
    assert "hang watchdog fired" in err and "preempted" in err


def test_a_long_run_does_not_consume_the_restart_budget(scripted, capsys):
    # Failing fast, one restart is all --max-restarts 1 allows...
    status, starts, err = scripted(capsys, "1,1,1,0", "--max-restarts", "1", "--reset-after", "0.2")
    assert (status, starts) == (1, 2), err
    # ...but each child that ran longer than --reset-after starts a new streak, backoff included.
    status, starts, err = scripted(capsys, "1@0.3,1@0.3,1@0.3,0", "--max-restarts", "1", "--reset-after", "0.2")
    assert (status, starts) == (EXIT_OK, 4), err
    assert waits(err) == [0.05, 0.05, 0.05]


def test_supervisor_jsonl_has_one_record_per_attempt(scripted, capsys, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    status, starts, err = scripted(capsys, "1,75,0", extra=(f"run.dir={tmp_path / 'elsewhere'}", f"run.dir={run_dir}"))
    assert (status, starts) == (EXIT_OK, 3), err
    records = [json.loads(line) for line in (run_dir / "supervisor.jsonl").read_text().splitlines()]
    assert [r["attempt"] for r in records] == [1, 2, 3]
    assert [r["exit_code"] for r in records] == [1, 75, 0]
    assert [r["action"] for r in records] == ["restart", "restart", "done"]
    assert [r["wait_s"] for r in records] == [0.05, 0.1, None]
    assert all(r["start"] <= r["end"] <= time.time() for r in records)
    assert records[1]["meaning"] == "preempted, checkpoint saved"
    assert not (tmp_path / "elsewhere").exists()  # the last run.dir wins, and none is ever created


def test_missing_command_is_bad_input(capsys):
    assert cli.main(["supervise", "--backoff", "1", "--"]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err.startswith("llama-jax: error: supervise needs a command")


def start_supervisor(tmp_path: Path, *options: str, child_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """`python -m llama_jax supervise` around SIGNALLED_CHILD, returned once the child is ready."""
    child = tmp_path / "child.py"
    child.write_text(SIGNALLED_CHILD)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_jax",
            "supervise",
            "--backoff",
            "0.05",
            *options,
            "--",
            sys.executable,
            str(child),
            str(tmp_path),
            *child_args,
        ],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.02)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_is_forwarded_as_sigterm_and_stops_without_restart(tmp_path, sig):
    proc = start_supervisor(tmp_path)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert (tmp_path / "got_signal").read_text() == str(int(signal.SIGTERM))  # so the trainer saves
    assert (tmp_path / "starts").read_text() == "x", err
    assert f"received {sig.name}" in err and "not restarting" in err


def test_child_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    proc = start_supervisor(tmp_path, "--grace", "0.3", child_args=("ignore",))
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 1, err
    assert 0.3 <= time.monotonic() - t0 < 10
    assert "sending SIGKILL" in err and "killed by SIGKILL" in err
    assert (tmp_path / "starts").read_text() == "x", err


def test_signal_during_backoff_stops_without_another_start(tmp_path):
    child = tmp_path / "child.py"
    child.write_text(SCRIPTED_CHILD)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_jax",
            "supervise",
            "--backoff",
            "30",
            "--",
            sys.executable,
            str(child),
            str(tmp_path / "starts"),
            "1",
        ],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:  # wait until it is backing off
        if "restart 1 of" in line:
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert (tmp_path / "starts").read_text() == "1"


def test_processes_left_behind_by_the_child_are_killed(tmp_path, capsys):
    pid_file = tmp_path / "orphan.pid"
    child = tmp_path / "child.py"
    child.write_text(
        "import subprocess, sys\n"
        "orphan = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(orphan.pid))\n"
    )
    assert cli.main(["supervise", "--", sys.executable, str(child)]) == EXIT_OK
    assert "killed processes the command left behind" in capsys.readouterr().err
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(pid):
        assert time.monotonic() < deadline, f"process {pid} left behind by the child is still running"
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """Running and not a zombie waiting to be reaped by init."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_on_kubernetes_the_supervisor_labels_the_nodes_a_pre_flight_verdict_names(tmp_path, capsys, monkeypatch):
    """launch/k8s.sh's pods: after exit 71 the supervisor labels each node the verdict names, through the API server
    (here a fake one), so the Job's node affinity keeps the replacement pods off them; no kubectl, no person."""
    import http.server
    import threading

    patches = []

    class FakeApiServer(http.server.BaseHTTPRequestHandler):
        def do_PATCH(self):  # noqa: N802 - the name http.server calls
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            patches.append((self.path, self.headers["Content-Type"], body))
            self.send_response(403 if self.path.endswith("/forbidden") else 200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeApiServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("LLAMA_JAX_K8S_API", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("LLAMA_JAX_LABEL_UNHEALTHY_NODES", "llama-jax.io/unhealthy=true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    child = tmp_path / "child.py"
    child.write_text(
        "import json, sys\nfrom pathlib import Path\n"
        "Path(sys.argv[1], 'unhealthy.json').write_text(json.dumps({'hosts': ['gpu-7', 'forbidden']}))\n"
        "sys.exit(71)\n"
    )
    try:
        status = cli.main(
            ["supervise", "--backoff", "0.05", "--", sys.executable, str(child), str(run_dir), f"run.dir={run_dir}"]
        )
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert status == EXIT_UNHEALTHY, err
    assert [p[0] for p in patches] == ["/api/v1/nodes/gpu-7", "/api/v1/nodes/forbidden"]
    assert patches[0][1:] == (
        "application/merge-patch+json",
        {"metadata": {"labels": {"llama-jax.io/unhealthy": "true"}}},
    )
    assert "labelled node gpu-7 llama-jax.io/unhealthy=true: the job's pods stay off it" in err
    assert "could not label node forbidden (HTTP Error 403" in err
    assert "kubectl label node forbidden llama-jax.io/unhealthy=true" in err


def test_a_supervised_run_that_saves_no_checkpoint_during_training_warns_at_start(tmp_path, corpus):
    """Under the supervisor (or a launcher) a crash restarts the run from its newest checkpoint; one that saves none
    until it ends would start again from step 0 after every failure, so it says so once, at start."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_jax",
            "supervise",
            "--",
            sys.executable,
            "-m",
            "llama_jax",
            "train",
            "tiny",
            f"run.dir={run_dir}",
            "train.steps=1",
            "train.warmup_steps=0",
            "model.n_layers=1",
            "model.d_model=32",
            "model.n_heads=2",
            "model.n_kv_heads=1",
            "model.ffn_dim=64",
            "train.seq_len=16",
            "train.batch_size=8",
            "train.sample_tokens=0",
            "model.vocab_size=320",
            f"data.sources=[{corpus}]",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stdout.splitlines() if "saves none until it ends" in line]
    assert warnings == [
        "warning: under llama-jax supervise a failed run restarts from its newest checkpoint, and this "
        "one saves none until it ends (checkpoint.every_steps=0, no every_minutes, no local tier): "
        "every restart starts again from step 0; set checkpoint.every_steps=auto"
    ], proc.stdout
