"""Fault tolerance end to end: real processes, real signals, real damage to checkpoint files.

The subprocess runs use one CPU device and a shared data cache and compilation cache, so each
costs a few seconds of start-up; the in-process runs use the 8 simulated devices of conftest.
"""

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from conftest import tiny_config, write_tiny_yaml

from llama_jax.checkpoint.checkpointer import Checkpointer
from llama_jax.checkpoint.durable import latest_checkpoint_step
from llama_jax.errors import EXIT_HANG, EXIT_PREEMPTED
from llama_jax.training.loop import train
from llama_jax.training.metrics import read_metrics
from llama_jax.training.run import load_checkpoint
from llama_jax.training.step import TrainProgram

STEPS = 12


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A config file for subprocess runs and caches they share (data store, compiled steps)."""
    return write_tiny_yaml(tmp_path_factory.mktemp("fault"), train={"steps": STEPS})


def command(config_path, run_dir, *overrides):
    return [sys.executable, "-m", "llama_jax", "train", str(config_path), f"run.dir={run_dir}", *overrides]


def environment():
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")  # one CPU device per subprocess
    return env


def run_to_end(config_path, run_dir, *overrides, timeout=300):
    proc = subprocess.run(command(config_path, run_dir, *overrides), env=environment(), capture_output=True,
                          text=True, timeout=timeout)
    return proc


def wait_for_step(run_dir, step, proc, timeout=240):
    """Block until metrics.jsonl records a training step >= `step`."""
    deadline = time.time() + timeout
    path = Path(run_dir) / "metrics.jsonl"
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        if path.exists():
            steps = [r["step"] for r in read_metrics(path) if "loss" in r]
            if steps and max(steps) >= step:
                return max(steps)
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout}s")


def final_params(run_dir, step, config_path):
    config = yaml.safe_load(Path(config_path).read_text())
    cfg = tiny_config(model=config["model"], train=dict(batch_size=8, seq_len=32), mesh=dict(fsdp=1),
                      run=dict(dir=str(run_dir)))
    state, _ = load_checkpoint(cfg, step, devices=jax.devices()[:1])
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def losses(run_dir):
    """step -> loss of the last record of each step (a resumed run re-logs the steps it recomputes)."""
    return {r["step"]: r["loss"] for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def straight(shared, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    proc = run_to_end(shared, run_dir)
    assert proc.returncode == 0, proc.stderr
    return run_dir


def test_kill_9_at_a_random_step_then_resume_is_bitwise_identical(shared, straight, tmp_path):
    run_dir = tmp_path / "run"
    kill_at = int(np.random.default_rng().integers(3, STEPS - 2))
    # The tiny steps take milliseconds, so the run is held at kill_at (an injected hang) to make the
    # kill land there, after the checkpoint before it is complete.
    proc = subprocess.Popen(command(shared, run_dir, f"fault.inject_hang_step={kill_at}"), env=environment(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_step(run_dir, kill_at, proc)
    deadline = time.time() + 60
    while latest_checkpoint_step(run_dir) < kill_at - kill_at % 2 and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert latest_checkpoint_step(run_dir) == kill_at - kill_at % 2
    resumed = run_to_end(shared, run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {run_dir / 'checkpoints' / str(kill_at - kill_at % 2)}" in resumed.stdout
    for a, b in zip(final_params(run_dir, STEPS, shared), final_params(straight, STEPS, shared)):
        np.testing.assert_array_equal(a, b)
    assert losses(run_dir) == losses(straight)
    goodput = json.loads((run_dir / "goodput.json").read_text())
    assert len(goodput["attempts"]) == 2


def test_sigterm_saves_the_current_step_and_exits_75(shared, straight, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(command(shared, run_dir, "checkpoint.every_steps=0", "train.steps=400"),
                            env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(run_dir, 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    saved = latest_checkpoint_step(run_dir)
    assert saved >= 3 and f"saved step {saved}" in out
    assert max(losses(run_dir)) == saved  # zero steps lost: the step it stopped at is the one saved
    resumed = run_to_end(shared, run_dir, f"train.steps={saved + 2}")
    assert resumed.returncode == 0 and f"resumed from {run_dir / 'checkpoints' / str(saved)}" in resumed.stdout


def test_hang_watchdog_dumps_stacks_and_exits_124(shared, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_to_end(shared, run_dir, "fault.inject_hang_step=6", "fault.hang_min_timeout_s=3",
                      "fault.hang_factor=2", timeout=240)
    assert proc.returncode == EXIT_HANG, proc.stderr
    (dump,) = run_dir.glob("hang-*.txt")
    text = dump.read_text()
    assert "_injected_hang" in text  # the main thread's stack shows where it is stuck
    assert "collectives per device per step" in text  # the compiled step's communication summary


def test_supervisor_never_retries_bad_input(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "llama_jax", "supervise", "--backoff", "0.01", "--",
                           sys.executable, "-m", "llama_jax", "train", "train.steps=-1", f"run.dir={tmp_path / 'r'}"],
                          env=environment(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("train.steps must be >= 0") == 1


# --------------------------------------------------------------------------------------------
# In process, on the simulated devices


def config_for(tmp_path, corpus, **sections):
    base = dict(train=dict(steps=6, lr=1e-2), data=dict(sources=[str(corpus)], cache_dir=str(tmp_path.parent / "cache")),
                checkpoint=dict(every_steps=2, keep=10), run=dict(compilation_cache="off"))
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return tiny_config(tmp_path, **base)


def train_quietly(cfg, devices=None, messages=None):
    return train(cfg, print_fn=(messages.append if messages is not None else lambda _: None), devices=devices)


def corrupt(step_dir: Path, mode: str) -> None:
    arrays = sorted((step_dir / "state" / "d").iterdir())
    if mode == "truncated-array":
        data = arrays[-1].read_bytes()
        arrays[-1].write_bytes(data[: len(data) // 2])
    elif mode == "deleted-array":
        arrays[-1].unlink()
    elif mode == "missing-manifest":
        (step_dir / "state" / "manifest.ocdbt").unlink()
    elif mode == "empty-step-dir":
        shutil.rmtree(step_dir)
        step_dir.mkdir()


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory, corpus):
    """A run trained to step 6, checkpoints at 2, 4 and 6; tests damage copies of it."""
    cfg = config_for(tmp_path_factory.mktemp("six") / "base", corpus)
    train_quietly(cfg)
    return cfg


@pytest.mark.parametrize("mode", ["truncated-array", "deleted-array", "missing-manifest", "empty-step-dir",
                                  "interrupted-save"])
def test_a_damaged_newest_checkpoint_falls_back_and_is_kept_aside(mode, tmp_path, six_steps):
    cfg = dataclasses.replace(six_steps, run=dataclasses.replace(six_steps.run, dir=str(tmp_path / "run")))
    shutil.copytree(six_steps.run.dir, cfg.run.dir)
    checkpoints = Path(cfg.run.dir) / "checkpoints"
    if mode == "interrupted-save":  # a save killed half-way leaves Orbax's temporary directory
        shutil.copytree(checkpoints / "6", checkpoints / "8.orbax-checkpoint-tmp-1234")
        expected_start = 6
    else:
        corrupt(checkpoints / "6", mode)
        expected_start = 4
    messages = []
    longer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=8))
    train_quietly(longer, messages=messages)
    assert any(m == f"resumed from {checkpoints / str(expected_start)}" for m in messages), messages
    if mode != "interrupted-save":
        warning = next(m for m in messages if m.startswith("warning: checkpoint step 6"))
        assert "corrupt" in warning
        (kept,) = (checkpoints / "corrupt").iterdir()
        assert kept.name.startswith("6-")  # set aside, not deleted
    assert latest_checkpoint_step(Path(cfg.run.dir)) == 8


@pytest.fixture(scope="module")
def saved_on_fsdp8(tmp_path_factory, corpus):
    """(losses of a straight 8-step run, config of a 4-step run) on fsdp=8, with a constant learning rate:
    the schedule then does not depend on train.steps, so the 4-step run raised to 8 follows the straight one."""
    root = tmp_path_factory.mktemp("moved")
    constant = dict(min_lr_ratio=1.0)
    straight = config_for(root / "straight", corpus, train=dict(steps=8, **constant), mesh=dict(fsdp=8))
    train_quietly(straight)
    half = config_for(root / "half", corpus, train=dict(steps=4, **constant), mesh=dict(fsdp=8))
    train_quietly(half)
    return losses(straight.run.dir), half


@pytest.mark.parametrize("mesh", [dict(data=2, fsdp=1, tensor=4), dict(fsdp=2, sequence=4), "one-device"],
                         ids=["data2xtensor4", "fsdp2xsequence4", "one-device"])
def test_restore_onto_another_mesh_continues_with_the_same_losses(mesh, tmp_path, saved_on_fsdp8):
    expected, half = saved_on_fsdp8
    run_dir = tmp_path / "run"
    shutil.copytree(half.run.dir, run_dir)
    devices = jax.devices()[:1] if mesh == "one-device" else None
    moved = dataclasses.replace(half, run=dataclasses.replace(half.run, dir=str(run_dir)),
                                train=dataclasses.replace(half.train, steps=8),
                                mesh=dataclasses.replace(half.mesh, **(dict(fsdp=1) if devices else mesh)))
    messages = []
    train_quietly(moved, devices=devices, messages=messages)
    assert f"resumed from {run_dir / 'checkpoints' / '4'}" in messages
    got, steps = losses(run_dir), [5, 6, 7, 8]
    np.testing.assert_allclose([got[s] for s in steps], [expected[s] for s in steps], rtol=1e-5)


def test_injected_nan_is_skipped_and_never_saved(tmp_path, corpus):
    cfg = config_for(tmp_path, corpus, checkpoint=dict(every_steps=1), fault=dict(inject_nan_steps=[2]))
    messages = []
    summary = train_quietly(cfg, messages=messages)
    assert "warning: step 3 skipped: non-finite loss or gradient norm" in messages
    assert summary["skipped_steps"] == 1
    program = TrainProgram.for_config(cfg)
    checkpointer = Checkpointer(Path(cfg.run.dir), cfg.checkpoint)
    with program.activate():
        states = {s: checkpointer.restore(s, program.abstract_state())[0] for s in (2, 3, 4)}
    checkpointer.close()
    for before, after in zip(jax.tree.leaves(states[2].params), jax.tree.leaves(states[3].params)):
        np.testing.assert_array_equal(np.asarray(before), np.asarray(after))  # the update was skipped
    for state in states.values():
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))
    assert int(states[3].step) == 3


@pytest.mark.parametrize("every_steps, bad, rolled_back", [
    (3, [3, 4, 5], "rolled back from step 6 to 3"),  # the third bad step is saved: read before its save
    (4, [4, 5, 6], "rolled back from step 8 to 4"),  # step 7 is read after step 8 is dispatched: 8 is dropped too
])
def test_consecutive_bad_steps_roll_back_to_the_last_checkpoint(tmp_path, corpus, every_steps, bad, rolled_back):
    cfg = config_for(tmp_path, corpus, train=dict(steps=10), checkpoint=dict(every_steps=every_steps),
                     fault=dict(inject_nan_steps=bad, max_bad_steps=3))
    messages = []
    summary = train_quietly(cfg, messages=messages)
    assert any(rolled_back in m for m in messages), messages
    assert summary["skipped_steps"] == 3
    assert latest_checkpoint_step(Path(cfg.run.dir)) == 10
    assert summary["goodput"]["lost"] > 0
    losses = [r for r in read_metrics(Path(cfg.run.dir) / "metrics.jsonl") if "loss" in r]
    assert losses[-1]["step"] == 10 and all(math.isfinite(r["loss"]) for r in losses[-3:])


def test_auto_checkpoint_interval_follows_young_daly(tmp_path, corpus):
    """every_steps=auto: the first save is timed, then saves come every sqrt(2 x save x MTBF) / step time."""
    cfg = config_for(tmp_path, corpus, train=dict(steps=12), checkpoint=dict(every_steps="auto", mtbf_hours=1e-4,
                                                                               keep=20))
    messages = []
    train_quietly(cfg, messages=messages)
    (line,) = [m for m in messages if m.startswith("checkpoint.every_steps=auto:")]
    every = int(line.rsplit("saving every ", 1)[1].split()[0])
    assert every >= 1
    saved = sorted(int(p.name) for p in (Path(cfg.run.dir) / "checkpoints").iterdir() if p.name.isdigit())
    # The first save comes after step 1 (to measure one), the rest on the interval, and one at the end.
    assert saved == sorted({1, *range(every, 13, every), 12})
