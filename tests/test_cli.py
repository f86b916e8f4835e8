"""End to end through the installed `llama-jax` console script, in subprocesses on one CPU device."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from llama_jax.config import load_config

SCRIPT = Path(sys.executable).with_name("llama-jax")
if not SCRIPT.exists():
    SCRIPT = Path(shutil.which("llama-jax"))


def llama_jax(*args):
    """Run the console script as a user would: no simulated devices (XLA_FLAGS unset)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env, timeout=900)


def show(proc):
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def test_report_of_a_non_run_exits_2(tmp_path):
    """`llama-jax report` on a directory without metrics.jsonl exits 2 with one error line."""
    proc = llama_jax("report", tmp_path)
    assert proc.returncode == 2, show(proc)
    assert proc.stderr.startswith("llama-jax: error: ") and len(proc.stderr.splitlines()) == 1
    assert "metrics.jsonl" in proc.stderr
    assert not (tmp_path / "report.png").exists()


def test_default_train_end_to_end_and_resume(tmp_path):
    """The default preset trains, writes the run directory, reports, and resumes (no-op, then to more steps)."""
    run_dir = tmp_path / "run"
    train = [
        "train",
        "train.steps=4",
        "train.warmup_steps=1",
        "train.eval_batches=2",
        "train.sample_tokens=8",
        "train.log_every=2",
        f"run.dir={run_dir}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]

    # 1. A fresh run.
    proc = llama_jax(*train)
    assert proc.returncode == 0, show(proc)
    assert "eval loss" in proc.stdout

    assert load_config(str(run_dir / "config.yaml")).train.steps == 4
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    assert train_records and [r["step"] for r in train_records][-1] == 4
    for record in train_records:
        assert {"step", "loss", "tokens_per_s", "mfu"} <= set(record)
        assert record["loss"] > 0
    # Throughput may be null for the step that compiled, but is measured for the later ones.
    measured = [r for r in train_records if r["tokens_per_s"] is not None]
    assert measured and all(r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in measured)
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 4]
    assert (run_dir / "checkpoints" / "4").is_dir()
    assert (run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "sample.txt").read_text().startswith("ROMEO:")

    # 2. A report of the finished run.
    (run_dir / "report.png").unlink()
    proc = llama_jax("report", run_dir)
    assert proc.returncode == 0, show(proc)
    assert (run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # 3. The same command again: nothing left to do.
    proc = llama_jax(*train)
    assert proc.returncode == 0, show(proc)
    assert "already trained" in proc.stdout
    assert not (run_dir / "checkpoints" / "5").exists()

    # 4. More steps: resume from the step-4 checkpoint and continue to 6.
    proc = llama_jax(*[a if a != "train.steps=4" else "train.steps=6" for a in train])
    assert proc.returncode == 0, show(proc)
    assert "resumed" in proc.stdout and str(run_dir / "checkpoints" / "4") in proc.stdout
    assert (run_dir / "checkpoints" / "6").is_dir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 4, 6]
    assert max(r["step"] for r in records if "loss" in r) == 6
