"""Storage faults: a full, read-only or failing checkpoint filesystem gets one clear line, loses nothing, and never
sends the supervisor into a restart loop. Failures are injected (inject.save_failure_steps: a durable write
fails with ENOSPC), and where the machine lets a test mount one, a real small tmpfs fills up or goes read-only."""

import contextlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import subprocess_environment, tiny_config, write_tiny_yaml

from llama_jax import cli
from llama_jax.checkpoint.durable import step_directories
from llama_jax.errors import EXIT_BAD_INPUT, EXIT_STORAGE
from llama_jax.training.loop import train

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launch" / "multiprocess.py"


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    return write_tiny_yaml(tmp_path_factory.mktemp("storage"), train={"steps": 8})


def llama_jax(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "llama_jax", *map(str, args)],
        env=subprocess_environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("llama-jax: error:")]


def leftovers(run_dir: Path) -> list[str]:
    return [p.name for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A real tmpfs of `size` at `path` (root, and a kernel that lets the test mount: else the test skips)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_failed_durable_save_warns_in_one_line_removes_the_step_and_the_run_goes_on(tmp_path, corpus):
    """The save of step 4 fails (no space, injected): one warning naming the step, the reason, the directory and its
    free space; step 4 is removed, step 2 stays, training goes on and saves 6 and 8."""
    cfg = tiny_config(
        tmp_path,
        train=dict(steps=8),
        data=dict(sources=[str(corpus)]),
        checkpoint=dict(every_steps=2, keep=10),
        inject=dict(process=0, save_failure_steps=[4]),
    )
    messages = []
    summary = train(cfg, print_fn=messages.append)
    assert summary["exit_code"] == 0
    (warning,) = [m for m in messages if "checkpoint save of step 4 failed" in m]
    checkpoints = Path(cfg.run.dir) / "checkpoints"
    assert re.match(
        rf"warning: checkpoint save of step 4 failed on process 0: No space left on device \(ENOSPC\) in "
        rf"{re.escape(str(checkpoints.absolute()))}, [\d.]+ \w+ free there; the newest complete checkpoint "
        r"is step 2; training goes on and saves again at the next interval \(1 of "
        r"checkpoint.max_failed_saves=2 failed saves in a row\)$",
        warning,
    ), warning
    assert step_directories(checkpoints) == [2, 6, 8] and not leftovers(Path(cfg.run.dir))


def test_failed_saves_in_a_row_stop_with_exit_74_and_the_supervisor_does_not_restart(config_path, tmp_path):
    """Three failed saves in a row with checkpoint.max_failed_saves=2: exit 74 in one line saying what failed, where,
    the free space and the newest complete step; the supervisor stops at once (the storage needs a person)."""
    run_dir = tmp_path / "run"
    proc = llama_jax(
        "supervise",
        "--backoff",
        "0.05",
        "--",
        sys.executable,
        "-m",
        "llama_jax",
        "train",
        config_path,
        f"run.dir={run_dir}",
        "train.steps=12",
        "inject.process=0",
        "inject.save_failure_steps=[4,6,8]",
    )
    assert proc.returncode == EXIT_STORAGE, proc.stderr
    (line,) = errors(proc.stderr)
    assert "checkpoint save of step 8 failed on process 0: No space left on device (ENOSPC)" in line
    assert (
        "free there; 3 saves failed in a row (checkpoint.max_failed_saves=2): stopping (exit 74); the newest "
        "complete checkpoint is step 2; free space or fix the filesystem, then re-run the same command" in line
    )
    assert proc.stderr.count("llama-jax supervise: start #") == 1
    assert "#1 checkpoint storage failing (exit 74)" in proc.stderr and "not restarting" in proc.stderr
    assert step_directories(run_dir / "checkpoints") == [2] and not leftovers(run_dir)


@pytest.mark.slow
def test_two_processes_agree_on_a_save_that_failed_on_one_of_them(config_path, tmp_path):
    """Process 1's save of step 4 fails (max_failed_saves=0: stop at the first): both processes stop with exit 74
    and the same line, and the newest complete step is the same for both: 2."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            str(LAUNCHER),
            "--processes",
            "2",
            "--devices",
            "4",
            "--grace",
            "10",
            "--",
            "train",
            str(config_path),
            f"run.dir={run_dir}",
            "checkpoint.max_failed_saves=0",
            "inject.process=1",
            "inject.save_failure_steps=[4]",
        ],
        env=subprocess_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == EXIT_STORAGE, proc.stderr
    lines = errors(proc.stderr)
    assert len(lines) == 2 and lines[0] == lines[1], proc.stderr  # one line per process, the same on both
    assert "checkpoint save of step 4 failed on process 1: No space left on device" in lines[0]
    assert "the newest complete checkpoint is step 2" in lines[0]
    assert re.findall(r"process \d exited with status (\d+)", proc.stderr) == ["74", "74"]
    assert step_directories(run_dir / "checkpoints") == [2] and not leftovers(run_dir)


def test_a_real_full_tmpfs_stops_the_run_in_one_line_and_its_logs_only_warn(config_path, tmp_path):
    """run.dir on a tmpfs with room for one checkpoint: the next saves fail for real (TensorStore's ENOSPC), the
    metrics and goodput writes on the same disk warn once each, and the run stops with exit 74 after
    checkpoint.max_failed_saves=1, leaving step 2 valid and no partial step."""
    with tmpfs(tmp_path / "disk", "2m") as disk:
        run_dir = disk / "run"
        proc = llama_jax(
            "train",
            config_path,
            f"run.dir={run_dir}",
            "checkpoint.max_failed_saves=1",
            "checkpoint.keep=10",
            "train.steps=12",
        )
        assert proc.returncode == EXIT_STORAGE, proc.stderr
        (line,) = errors(proc.stderr)
        assert re.search(
            r"checkpoint save of step \d+ failed on process 0: No space left on device \(ENOSPC\) in "
            rf"{re.escape(str(run_dir / 'checkpoints'))}, [\d.]+ \w+ free there",
            line,
        ), line
        assert step_directories(run_dir / "checkpoints")[0] == 2 and not leftovers(run_dir)
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("case", ["a-file", "a-file-on-the-way", "read-only"])
def test_an_unwritable_run_dir_is_one_line_and_exit_2_before_anything_compiles(case, config_path, tmp_path, capsys):
    with contextlib.ExitStack() as stack:
        if case == "read-only":
            disk = stack.enter_context(tmpfs(tmp_path / "ro", "1m"))
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
            run_dir, named = disk / "run", f"{disk} is on a read-only file system"
        else:
            (tmp_path / "file").write_text("not a directory")
            run_dir = tmp_path / "file" if case == "a-file" else tmp_path / "file" / "run"
            named = f"{tmp_path / 'file'} is a file"
        assert cli.main(["train", str(config_path), f"run.dir={run_dir}"]) == EXIT_BAD_INPUT
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"llama-jax: error: run.dir {run_dir} cannot be written: {named}")
        assert line.endswith("choose a run.dir on a writable filesystem")


def test_prepare_on_a_disk_that_fills_up_is_one_line_and_resumes_once_there_is_room(tmp_path, corpus):
    """`llama-jax prepare` into a tmpfs too small for the store: one line, exit 2, what was written kept; after the
    disk grows, the same command completes."""
    with tmpfs(tmp_path / "disk", "40k") as disk:
        out = disk / "store"
        command = ["prepare", str(corpus), "--out", str(out), "--train-tokenizer", "300", "--workers", "1"]
        proc = llama_jax(*command)
        assert proc.returncode == EXIT_BAD_INPUT, proc.stderr
        (line,) = errors(proc.stderr)
        assert line.startswith(f"llama-jax: error: writing the token store {out} failed: No space left on device")
        assert line.endswith("re-run the same command once there is room and it resumes") and out.is_dir()
        subprocess.run(["mount", "-o", "remount,size=20m", str(disk)], check=True)
        again = llama_jax(*command)
        assert again.returncode == 0, again.stderr
        assert (out / "meta.json").is_file()


def test_metrics_that_cannot_be_written_warn_once_and_training_goes_on(tmp_path, corpus, monkeypatch):
    """metrics.jsonl and TensorBoard's writes fail (a full disk): one warning each, and the run trains to its end
    and saves its checkpoint."""
    from llama_jax.training import metrics

    cfg = tiny_config(tmp_path, train=dict(steps=4), data=dict(sources=[str(corpus)]), run=dict(tensorboard=True))

    class FullDisk:
        def write(self, *args):
            raise OSError(28, "No space left on device")

        flush = close = write
        closed = False

    opened = metrics.MetricsLog.__init__

    def on_a_full_disk(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        if self._file is not None:
            self._file.close()
            self._file = FullDisk()

    monkeypatch.setattr(metrics.MetricsLog, "__init__", on_a_full_disk)
    monkeypatch.setattr(metrics.SummaryWriter, "add_scalar", lambda *args, **kwargs: FullDisk().write())
    messages = []
    summary = train(cfg, print_fn=messages.append)
    assert summary["exit_code"] == 0 and step_directories(Path(cfg.run.dir) / "checkpoints") == [4]
    warnings = [m for m in messages if m.startswith("warning: writing") and "sample or report" not in m]
    assert warnings == [
        "warning: writing metrics.jsonl failed (No space left on device); training goes on without "
        "it until it can be written again",
        "warning: writing TensorBoard failed (No space left on device); training goes on without it "
        "until it can be written again",
    ], messages
