"""The node-local checkpoint tier with real processes (issue 21): 2 processes x 2 simulated devices over
127.0.0.1, each process with its own local directory, a local save every 2 steps, a durable one every 10.

One run is killed at step 15 (SIGKILL to process 1, after both processes finished their local step 14);
each test restarts a copy of it after some damage, and the final parameters must be bitwise those of a
run that was never interrupted.
"""

import os
import re
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
from conftest import subprocess_environment, tiny_config, write_tiny_yaml

from llama_jax.checkpoint.local_files import finished_steps, host_directory, process_directory
from llama_jax.resilience.goodput import read_goodput
from llama_jax.training.metrics import read_metrics
from llama_jax.training.run import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launch" / "multiprocess.py"
STEPS, KILL_AT = 20, 15
TIERS = ("checkpoint.every_steps=10", "checkpoint.local_every_steps=2", "checkpoint.local_keep=2")


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    return write_tiny_yaml(tmp_path_factory.mktemp("local-tier"), train={"steps": STEPS})


def command(config_path, run_dir, local_dir, *overrides):
    return [
        sys.executable,
        str(LAUNCHER),
        "--processes",
        "2",
        "--devices",
        "2",
        "--grace",
        "2",
        "--",
        "train",
        str(config_path),
        f"run.dir={run_dir}",
        f"checkpoint.local_dir={local_dir}",
        *TIERS,
        *overrides,
    ]


def run(config_path, run_dir, local_dir, *overrides):
    proc = subprocess.run(
        command(config_path, run_dir, local_dir, *overrides),
        env=subprocess_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def final_state(run_dir, config_path):
    """The train state saved at the last step, read on one device."""
    model = yaml.safe_load(Path(config_path).read_text())["model"]
    cfg = tiny_config(model=model, train=dict(batch_size=8, seq_len=32), mesh=dict(fsdp=1), run=dict(dir=str(run_dir)))
    state, data = load_checkpoint(cfg, STEPS, devices=jax.devices()[:1])
    return [np.asarray(x) for x in jax.tree.leaves(state)], data


def assert_bitwise(a, b):
    (leaves_a, data_a), (leaves_b, data_b) = a, b
    assert data_a == data_b
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def straight_run(config_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("straight")
    run(config_path, root / "run", root / "local")
    return root / "run"


@pytest.fixture(scope="module")
def straight(straight_run, config_path):
    return final_state(straight_run, config_path)


@pytest.fixture(scope="module")
def killed(config_path, tmp_path_factory):
    """A run held at step 15 (an injected hang) once both processes finished local step 14, then SIGKILLed in
    process 1; the launcher stops process 0 after its grace. Its durable tier holds step 10 only."""
    root = tmp_path_factory.mktemp("killed")
    run_dir, local_dir = root / "run", root / "local"
    launcher = subprocess.Popen(
        command(config_path, run_dir, local_dir, f"inject.hang_step={KILL_AT}"),
        env=subprocess_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: dict[int, int] = {}
    while len(pids) < 2:
        line = launcher.stderr.readline()
        assert line or launcher.poll() is None, launcher.communicate()
        if match := re.match(r"multiprocess: process (\d) started \(pid (\d+)\)", line):
            pids[int(match.group(1))] = int(match.group(2))
    deadline = time.time() + 240
    dirs = [process_directory(str(local_dir), run_dir, i) for i in range(2)]
    while time.time() < deadline and not all(KILL_AT - 1 in finished_steps(d) for d in dirs):
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.1)
    os.kill(pids[1], signal.SIGKILL)
    launcher.communicate(timeout=120)
    assert launcher.returncode != 0
    assert [finished_steps(d) for d in dirs] == [[12, 14], [12, 14]]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["10"]
    return run_dir, local_dir


def copy_of(killed, tmp_path):
    """The killed run at a new path, its local directories with it (they are keyed by the run's path)."""
    run_dir, local_dir = tmp_path / "run", tmp_path / "local"
    shutil.copytree(killed[0], run_dir)
    for i in range(2):
        shutil.copytree(process_directory(str(killed[1]), killed[0], i), process_directory(str(local_dir), run_dir, i))
    return run_dir, local_dir


@pytest.mark.slow
def test_a_killed_process_restarts_from_its_local_step_and_ends_bitwise_equal(killed, straight, config_path, tmp_path):
    run_dir, local_dir = copy_of(killed, tmp_path)
    proc = run(config_path, run_dir, local_dir)
    assert "restored step 14 from the local tier (own copies)" in proc.stdout, proc.stdout
    assert f"resumed from {process_directory(str(local_dir), run_dir, 0) / '14'}" in proc.stdout
    assert_bitwise(final_state(run_dir, config_path), straight)
    tiers = read_goodput(run_dir)["tiers"]
    assert tiers["restore_local"]["count"] == 1 and "restore_durable" not in tiers
    assert read_goodput(run_dir)["restores"] == {"local (own copies)": 1}
    assert tiers["save_local"]["count"] >= 7 and tiers["write_local"]["bytes"] > 0


@pytest.mark.slow
def test_a_lost_host_restores_from_its_partners_copy(killed, straight, config_path, tmp_path):
    """Process 1's host is gone with its local directory: process 0 holds its shards of step 14."""
    run_dir, local_dir = copy_of(killed, tmp_path)
    shutil.rmtree(process_directory(str(local_dir), run_dir, 1))
    proc = run(config_path, run_dir, local_dir)
    assert "restored step 14 from the local tier (own copies, and the partner's copy for process 1)" in proc.stdout
    assert_bitwise(final_state(run_dir, config_path), straight)
    assert read_goodput(run_dir)["restores"] == {"local (own copies, and the partner's copy for process 1)": 1}


@pytest.mark.slow
def test_a_corrupt_local_step_makes_every_process_fall_back_together(killed, straight, config_path, tmp_path):
    """Process 1's shards of step 14 are damaged in both copies (its own, and process 0's copy of them):
    step 14 cannot be served, and both processes restore step 12, setting 14 aside."""
    run_dir, local_dir = copy_of(killed, tmp_path)
    dirs = [process_directory(str(local_dir), run_dir, i) for i in range(2)]
    for damaged in (dirs[1] / "14" / "own.safetensors", dirs[0] / "14" / "partner-1.safetensors"):
        data = bytearray(damaged.read_bytes())
        data[-100] ^= 0xFF  # one flipped byte in the last tensor: the file still parses, its CRC-32 does not match
        damaged.write_bytes(bytes(data))
    proc = run(config_path, run_dir, local_dir)
    assert re.search(
        r"warning: local step 14 cannot be served to every process \(process 0: partner-1.safetensors "
        r"of step 14 fails its CRC-32 check; process 1: own.safetensors",
        proc.stdout,
    ), proc.stdout
    assert "restored step 12 from the local tier (own copies)" in proc.stdout
    assert [p.name.split("-")[:2] for d in dirs for p in d.iterdir() if p.name.startswith("corrupt")] == [
        ["corrupt", "14"],
        ["corrupt", "14"],
    ]
    assert_bitwise(final_state(run_dir, config_path), straight)


@pytest.mark.slow
def test_with_every_local_copy_gone_or_damaged_the_durable_tier_serves(
    killed, straight, straight_run, config_path, tmp_path
):
    """Process 0's host is gone with its local directory and process 1's own files of both local steps are damaged:
    no local step can be served, and the run restores step 10 from checkpoints/, ending bitwise equal. A restart
    of the undamaged run on another process count (one process of 4 devices) restores local step 14 all the same:
    the shards both processes saved, laid out on its mesh (relayout.restore_moved; bit for bit: the test below),
    and trains on to the straight run's losses (within 1e-5: one process sums in another order than two)."""
    run_dir, local_dir = copy_of(killed, tmp_path)
    shutil.rmtree(process_directory(str(local_dir), run_dir, 0))
    for step in (12, 14):
        damaged = process_directory(str(local_dir), run_dir, 1) / str(step) / "own.safetensors"
        damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    proc = run(config_path, run_dir, local_dir)
    assert f"resumed from {run_dir / 'checkpoints' / '10'}" in proc.stdout, proc.stdout
    assert read_goodput(run_dir)["restores"] == {"durable": 1}
    assert_bitwise(final_state(run_dir, config_path), straight)

    other, other_local = copy_of(killed, tmp_path / "other")
    single = subprocess.run(
        [
            sys.executable,
            str(LAUNCHER),
            "--processes",
            "1",
            "--devices",
            "4",
            "--",
            "train",
            str(config_path),
            f"run.dir={other}",
            f"checkpoint.local_dir={other_local}",
            *TIERS,
        ],
        env=subprocess_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    moved = "restored step 14 from the local tier (the shards of 2 processes, read on process 0 of 1)"
    assert moved in single.stdout, single.stdout
    assert f"resumed from {host_directory(str(other_local), other)}/process-*/14" in single.stdout
    got, want = (
        {r["step"]: r["loss"] for r in read_metrics(d / "metrics.jsonl") if "loss" in r} for d in (other, straight_run)
    )
    np.testing.assert_allclose(
        [got[s] for s in range(15, STEPS + 1)], [want[s] for s in range(15, STEPS + 1)], rtol=1e-5
    )


def test_the_partner_exchange_goes_in_batches_bounded_in_bytes_per_device():
    from llama_jax.checkpoint.local import _batches

    assert _batches([300, 500, 300, 2000, 100], lambda size: size, 800) == [[300, 500], [300], [2000], [100]]
    assert _batches([], lambda size: size, 800) == []


def test_a_step_saved_on_one_mesh_is_laid_out_bit_for_bit_on_another(tmp_path):
    """relayout.restore_moved in one process: a state saved sharded over 8 devices (rows over all 8, a matrix over
    4 x 2, a replicated scalar) comes back on 2 devices in other shardings, every bit as saved; a step that does not
    tile the new arrays is refused in one line."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from llama_jax.checkpoint.local import LocalTier
    from llama_jax.checkpoint.relayout import restore_moved
    from llama_jax.distributed.peers import Peers

    rng = np.random.default_rng(0)
    values = {
        "rows": rng.standard_normal((16, 3)).astype(np.float32),
        "matrix": rng.standard_normal((8, 6)).astype(np.float32),
        "count": np.int32(7),
    }
    eight = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    saved_specs = {"rows": P(("a", "b")), "matrix": P("a", "b"), "count": P()}
    state = {k: jax.device_put(v, NamedSharding(eight, saved_specs[k])) for k, v in values.items()}
    peers = Peers(timeout_s=10)
    saver = LocalTier(str(tmp_path / "local"), tmp_path / "run", eight, peers, keep=2, replicas=0)
    saver.save(4, state, {"next_step": 4}, {"step": 4})
    saver.wait()

    two = Mesh(np.array(jax.devices()[:2]), ("x",))
    specs = {"rows": P(None, None), "matrix": P(None, "x"), "count": P()}
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(two, specs[k])) for k, v in values.items()
    }
    tier = LocalTier(str(tmp_path / "local"), tmp_path / "run", two, peers, keep=2, replicas=0)
    restored, data, copies = restore_moved(tier, 4, 1, abstract)
    assert data == {"next_step": 4} and copies == "the shards of 1 process, read on process 0 of 1"
    for k, v in values.items():
        assert restored[k].sharding == abstract[k].sharding
        np.testing.assert_array_equal(np.asarray(restored[k]), v)

    wider = dict(abstract, rows=jax.ShapeDtypeStruct((16, 4), np.float32, sharding=NamedSharding(two, P())))
    refused = restore_moved(tier, 4, 1, wider)
    assert (
        refused == "local step 4 cannot be laid out on this mesh: ['rows'] (its shards of dimension 1 are not "
        "equal parts of 4)"
    ), refused
